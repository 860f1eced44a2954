"""``deepspeed.ops.adam``'s optimizers, on ``torch.optim.Adam``.

:class:`FusedAdam` (DeepSpeed's multi-tensor CUDA Adam) and
:class:`DeepSpeedCPUAdam` (its vectorised host Adam for ZeRO-Offload) take
DeepSpeed's constructor arguments and are ``torch.optim.Adam`` underneath:
a step is torch's, with the same hyper-parameters - ``torch.optim.AdamW``'s
when ``adam_w_mode``/``adamw_mode`` is true (the default: decoupled weight
decay), ``torch.optim.Adam``'s otherwise (weight decay added to the
gradient). Per parameter group the switch is torch's
``decoupled_weight_decay`` key (older torch without it: this module decays
the parameters as AdamW does, then steps Adam without weight decay).

**Implementation.** Each optimizer runs torch's fastest kernel for the
parameters it is built over: ``fused=True`` where torch has fused Adam
kernels for every parameter's device and dtype (CUDA; the CPU too since
torch 2.4), else torch's own choice at step time (``foreach`` on CUDA). The
choice is made once for the whole optimizer, and ``fused``/``foreach`` keys
in given parameter groups are replaced by it: the copy a ZeRO stage
rebuilds over its fp32 masters (same class, same groups:
:func:`dsrun.runtime.zero.stepping.wrap_optimizer`) thus chooses for the
masters' device, host memory under ``offload_optimizer``.

**Where DeepSpeed differs**, each an error naming the option rather than a
silent change of numerics:

* ``bias_correction=False``: torch's Adam always corrects the moments' bias.
* ``DeepSpeedCPUAdam(fp32_optimizer_states=True)`` (the default) stepping a
  16-bit parameter: torch keeps Adam's state in the parameter's dtype.
  dsrun's engine hands the optimizer fp32 parameters or masters in every
  precision mode, so this concerns an optimizer used on its own;
  ``fp32_optimizer_states=False`` asks for exactly torch's behaviour.

``amsgrad=True`` works (torch's AMSGrad; DeepSpeed refuses it). Nothing is
compiled, and ``DeepSpeedCPUAdam`` also steps GPU parameters (DeepSpeed's
asserts they are in host memory).

DeepSpeed's submodule paths name the same classes:
``deepspeed.ops.adam.cpu_adam.DeepSpeedCPUAdam`` (:mod:`.cpu_adam`) and
``deepspeed.ops.adam.fused_adam.FusedAdam`` (:mod:`.fused_adam`).
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, Callable, Optional

import torch

from dsrun.errors import DsrunConfigError
from dsrun.runtime.zero.masters import fused_devices

__all__ = ["DeepSpeedCPUAdam", "FusedAdam"]

#: Whether torch's Adam has AdamW as a mode (``decoupled_weight_decay``; newer torch).
NATIVE_DECOUPLED = "decoupled_weight_decay" in \
    inspect.signature(torch.optim.Adam.__init__).parameters
IMPLEMENTATION_KEYS = ("fused", "foreach")
LOW_PRECISION = (torch.float16, torch.bfloat16)
_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)  # what torch's kernels take as is


def fastest_implementation(tensors: Iterable[torch.Tensor]) -> dict[str, Optional[bool]]:
    """torch Adam's ``fused``/``foreach`` arguments for ``tensors``: fused
    kernels where torch has them for every tensor's device and dtype, else
    None for both (torch decides at step time: foreach on CUDA, the
    single-tensor loop on the CPU, where foreach is no faster)."""
    devices = fused_devices()
    fusable = [type(t) in _PLAIN_TENSORS and t.device.type in devices and not t.is_sparse
               and torch.is_floating_point(t) for t in tensors]
    return {"fused": True if fusable and all(fusable) else None, "foreach": None}


def _param_groups(params: Any) -> list[Any]:
    """torch.optim's forms of ``params`` as a list; group dicts copied
    without implementation keys (the optimizer chooses: module docstring)."""
    if isinstance(params, torch.Tensor):
        raise TypeError("params must be an iterable of tensors or dicts (as for torch.optim), "
                        f"got a tensor of shape {tuple(params.shape)}")
    items = list(params)
    if not items or not isinstance(items[0], Mapping):
        return items
    groups = []
    for item in items:
        group = {k: v for k, v in item.items() if k not in IMPLEMENTATION_KEYS}
        if isinstance(group.get("params"), torch.Tensor):
            group["params"] = [group["params"]]
        elif "params" in group:
            group["params"] = list(group["params"])
        groups.append(group)
    return groups


def _tensors(items: list[Any]) -> Iterator[torch.Tensor]:
    """The tensors in a list of tensors, (name, tensor) pairs or group dicts."""
    for item in items:
        if isinstance(item, Mapping):
            yield from _tensors(list(item.get("params", ())))
        else:
            yield item[1] if isinstance(item, tuple) else item


def _torch_adam_step(optimizer: torch.optim.Adam, closure: Optional[Callable[[], Any]]) -> Any:
    """torch's Adam step on ``optimizer``, without the step-hook wrapper
    torch.optim puts around a class's ``step`` when it is first used: the
    subclass's own ``step`` has one, and hooks must run once per step."""
    step = torch.optim.Adam.step
    if getattr(step, "hooked", False):
        step = step.__wrapped__  # type: ignore[attr-defined]
    return step(optimizer, closure)


class _DeepSpeedAdam(torch.optim.Adam):
    """DeepSpeed's Adam options on torch's Adam (module docstring).

    ``options`` are the subclass's DeepSpeed-only constructor arguments; they
    are kept in ``defaults`` (so ZeRO's rebuild passes them on) and in every
    parameter group, where ``mode_key`` (the Adam/AdamW switch) sets the
    group's ``decoupled_weight_decay`` unless the group has one.
    """

    _mode_key = "adam_w_mode"
    fuses_where_torch_can = True  # ZeRO's inner optimizer: no pieces, labelled "fused"
    _torch_decouples = NATIVE_DECOUPLED  # tests turn it off to run the older-torch path

    def __init__(self, params: Any, *, lr: float, betas: tuple[float, float], eps: float,
                 weight_decay: float, amsgrad: bool, options: Mapping[str, Any]) -> None:
        self._options = dict(options)
        self._check_bias_correction(self._options["bias_correction"])
        items = _param_groups(params)
        kwargs: dict[str, Any] = fastest_implementation(_tensors(items))
        if self._torch_decouples:
            kwargs["decoupled_weight_decay"] = bool(self._options[self._mode_key])
        betas = tuple(b if isinstance(b, torch.Tensor) else float(b) for b in betas)  # type: ignore[assignment]
        super().__init__(items, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                         amsgrad=amsgrad, **kwargs)
        self.defaults.update(self._options)

    def _check_bias_correction(self, value: Any) -> None:
        if not value:
            raise DsrunConfigError(
                f"{type(self).__name__}(bias_correction={value!r}) is not supported: dsrun's "
                f"{type(self).__name__} is torch's Adam, which always corrects the moments' bias")

    @property
    def adam_w_mode(self) -> bool:
        """DeepSpeed's attribute: decoupled weight decay (AdamW) by default."""
        return bool(self._options[self._mode_key])

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        for key, value in self._options.items():
            param_group.setdefault(key, value)
        self._check_bias_correction(param_group["bias_correction"])
        param_group.setdefault("decoupled_weight_decay", bool(param_group[self._mode_key]))
        super().add_param_group(param_group)

    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:  # type: ignore[override]
        self._before_step()
        if self._torch_decouples:
            return _torch_adam_step(self, closure)
        return self._step_decaying_by_hand(closure)

    def _before_step(self) -> None:
        """Checks a subclass makes before each step."""

    def _step_decaying_by_hand(self, closure: Optional[Callable[[], Any]]) -> Any:
        """AdamW where torch's Adam has no ``decoupled_weight_decay``: scale
        the parameters by ``1 - lr * weight_decay`` (torch's AdamW does it
        first too), then step Adam with no weight decay."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        found_inf = getattr(self, "found_inf", None)  # set by GradScaler for fused steps
        skipped = found_inf is not None and bool(found_inf.item())
        decayed: list[tuple[dict[str, Any], Any]] = []
        with torch.no_grad():
            for group in self.param_groups:
                if not (group["decoupled_weight_decay"] and group["weight_decay"]):
                    continue
                params = [p for p in group["params"] if p.grad is not None]
                if params and not skipped:
                    torch._foreach_mul_(params, 1.0 - group["lr"] * group["weight_decay"])
                decayed.append((group, group["weight_decay"]))
                group["weight_decay"] = 0.0
        try:
            _torch_adam_step(self, None)
        finally:
            for group, weight_decay in decayed:
                group["weight_decay"] = weight_decay
        return loss


class FusedAdam(_DeepSpeedAdam):
    """DeepSpeed's ``FusedAdam`` on torch's Adam/AdamW (module docstring).

    ``adam_w_mode`` True (default): AdamW, decoupled weight decay; False:
    Adam with L2 weight decay. ``set_grad_none``: what :meth:`zero_grad`
    does when not told (DeepSpeed's default: gradients set to None).
    ``bias_correction`` must be True.
    """

    _mode_key = "adam_w_mode"

    def __init__(self, params: Any, lr: float = 1e-3, bias_correction: bool = True,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 adam_w_mode: bool = True, weight_decay: float = 0.0, amsgrad: bool = False,
                 set_grad_none: bool = True) -> None:
        self.set_grad_none = set_grad_none
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                         amsgrad=amsgrad,
                         options={"bias_correction": bias_correction,
                                  "adam_w_mode": adam_w_mode, "set_grad_none": set_grad_none})

    def zero_grad(self, set_to_none: Optional[bool] = None) -> None:  # type: ignore[override]
        """Drop the gradients (``set_to_none``, by default ``set_grad_none``)
        or zero them."""
        super().zero_grad(set_to_none=self.set_grad_none if set_to_none is None else set_to_none)


class DeepSpeedCPUAdam(_DeepSpeedAdam):
    """DeepSpeed's ``DeepSpeedCPUAdam`` on torch's Adam/AdamW (module docstring).

    ``adamw_mode`` True (default): AdamW; False: Adam with L2 weight decay.
    ``fp32_optimizer_states`` True (default) refuses to step a 16-bit
    parameter (torch would keep its state in 16 bits); False keeps the
    state in the parameter's dtype. ``bias_correction`` must be True. Runs
    on whatever device the parameters are on (ZeRO-Offload: host memory).
    """

    _mode_key = "adamw_mode"

    def __init__(self, model_params: Any, lr: float = 1e-3, bias_correction: bool = True,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0, amsgrad: bool = False, adamw_mode: bool = True,
                 fp32_optimizer_states: bool = True) -> None:
        self.fp32_optimizer_states = fp32_optimizer_states
        super().__init__(model_params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                         amsgrad=amsgrad,
                         options={"bias_correction": bias_correction, "adamw_mode": adamw_mode,
                                  "fp32_optimizer_states": fp32_optimizer_states})

    def _before_step(self) -> None:
        """``fp32_optimizer_states``: no 16-bit parameter may get its state."""
        for g, group in enumerate(self.param_groups):
            if not group["fp32_optimizer_states"]:
                continue
            for i, p in enumerate(group["params"]):
                if p.grad is not None and p.dtype in LOW_PRECISION and not self.state.get(p):
                    raise DsrunConfigError(
                        f"DeepSpeedCPUAdam(fp32_optimizer_states=True): parameter {i} of group "
                        f"{g} is {p.dtype}, and torch's Adam keeps its state in the "
                        "parameter's dtype. Step fp32 parameters (dsrun's engine gives the "
                        "optimizer fp32 masters under fp16/bf16) or pass "
                        "fp32_optimizer_states=False")


# DeepSpeed's submodules (``from deepspeed.ops.adam.cpu_adam import
# DeepSpeedCPUAdam``), imported here so that attribute access finds them too,
# as DeepSpeed's package does; they hold the classes defined above
from dsrun.ops.adam import cpu_adam, fused_adam  # noqa: E402,F401
