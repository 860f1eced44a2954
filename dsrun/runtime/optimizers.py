"""Build the torch optimizer that a config's ``optimizer {type, params}`` names.

DeepSpeed semantics kept here (deepspeed/runtime/engine.py,
``_configure_basic_optimizer``):

* Type names are case-insensitive (``"AdamW"`` == ``"adamw"``).
* **"Adam" means decoupled weight decay by default.** DeepSpeed's
  ``adam_w_mode`` param defaults to true, so type ``"Adam"`` builds
  ``torch.optim.AdamW``; ``"adam_w_mode": false`` builds ``torch.optim.Adam``
  (weight decay added to the gradient as an L2 term). Type ``"AdamW"`` is
  always AdamW, whatever ``adam_w_mode`` says (as in DeepSpeed).
* ``torch_adam`` selects torch's Adam/AdamW instead of DeepSpeed's FusedAdam.
  dsrun always uses torch's implementation, so the flag only changes the
  default ``weight_decay`` when none is given: without it, FusedAdam's 0.0
  (also for AdamW, whose torch default is 0.01); with it, torch's default.
* ``bias_correction`` (a FusedAdam param) is accepted only as true: torch's
  Adam always corrects bias.
* ``set_grad_none`` (FusedAdam's and FusedLion's, for ``"Adam"``,
  ``"AdamW"`` and ``"Lion"``) is accepted as true or false and changes
  nothing: it picks how DeepSpeed's ``zero_grad()`` clears gradients, and
  both ways leave them ``None`` with torch >= 2 (torch's ``zero_grad``
  sets them to None by default); dsrun's engine clears them itself.
* ``fp32_optimizer_states`` (DeepSpeedCPUAdam's, under ``offload_optimizer``)
  is accepted as true or false and changes nothing: it keeps the moments in
  fp32 (true) or in the stepped parameters' dtype (false), and ZeRO steps
  fp32 masters (DeepSpeed 0.19.8's moments are fp32 either way too, unless
  16-bit masters or ``bf16_optimizer_states``, which dsrun refuses).
* ``"Lamb"`` is :class:`Lamb` below (DeepSpeed's FusedLamb, on any device).
* ``max_grad_norm`` is rejected in favour of ``gradient_clipping`` (checked
  when the config is resolved), as in DeepSpeed.
* Other types are torch.optim classes with their own parameter names
  (DeepSpeed builds any ``torch.optim`` class by name; dsrun's list is in
  the config module, which says why LBFGS and SparseAdam are refused).
  Those whose update is not elementwise (Adafactor) are refused at the ZeRO
  stages (:data:`~dsrun.runtime.zero.groups.UNSHARDABLE_OPTIMIZERS`).

Parameter names are checked against the chosen class's signature (they
depend on the installed torch): a bad name is a :class:`DsrunConfigError`
listing the valid ones with a did-you-mean suggestion.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, Callable, Optional

import torch
from torch.optim import Optimizer

from dsrun.errors import DsrunConfigError
from dsrun.runtime.config import OPTIMIZER_NAMES, OptimizerConfig, did_you_mean
from dsrun.runtime.config_param_values import OPTIMIZER_VALUES


def _closure_loss(closure: Optional[Callable[[], Any]]) -> Any:
    """``closure()`` with gradients enabled (inside an optimizer's step), or None."""
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()


def _with_grads(optimizer: Optimizer, name: str) -> Iterator[tuple[dict[str, Any], Any]]:
    """``(group, param)`` for every parameter with a dense gradient."""
    for group in optimizer.param_groups:
        for param in group["params"]:
            if param.grad is None:
                continue
            if param.grad.is_sparse:
                raise RuntimeError(f"{name} does not support sparse gradients")
            yield group, param


class Lamb(Optimizer):
    """LAMB (You et al. 2019) with DeepSpeed FusedLamb's semantics.

    Per parameter tensor, at step t with ``bc1 = 1 - beta1**t``,
    ``bc2 = 1 - beta2**t``, as DeepSpeed's kernel
    (``csrc/lamb/fused_lamb_cuda_kernel.cu``) computes it::

        m = beta1 m + (1 - beta1) g          v = beta2 v + (1 - beta2) g^2
        update = m / (sqrt(v) + eps) + weight_decay * w      (moments uncorrected)
        trust = clamp(||w|| / ||update||, min_coeff, max_coeff)  (1 if a norm is 0)
        w = w - step_size * trust * update,  step_size = lr * sqrt(bc2) / bc1

    (``step_size = lr`` when ``bias_correction`` is false): the bias
    correction scales the step, not the update the trust ratio is taken
    of. ``eps_inside_sqrt`` puts eps under the root: ``sqrt(v + eps)``.
    The trust ratio needs whole-tensor norms: a sharded (ZeRO) optimizer
    must not run this per shard. ``get_lamb_coeffs()`` returns the last
    step's trust ratios, as FusedLamb does.
    """

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, bias_correction: bool = True,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 eps_inside_sqrt: bool = False, weight_decay: float = 0.0,
                 max_coeff: float = 10.0, min_coeff: float = 0.01, amsgrad: bool = False) -> None:
        if amsgrad:
            raise DsrunConfigError("Lamb does not support amsgrad (as DeepSpeed's FusedLamb)")
        checks = {"lr": lr >= 0.0, "eps": eps >= 0.0, "weight_decay": weight_decay >= 0.0,
                  "betas": len(betas) == 2 and all(0.0 <= b < 1.0 for b in betas),
                  "min_coeff": 0.0 <= min_coeff <= max_coeff}
        for name, ok in checks.items():
            if not ok:
                raise DsrunConfigError(f"Lamb: invalid {name}: lr={lr}, betas={betas}, eps={eps}, "
                                       f"weight_decay={weight_decay}, min_coeff={min_coeff}, "
                                       f"max_coeff={max_coeff}")
        defaults = dict(lr=lr, bias_correction=bias_correction, betas=tuple(betas), eps=eps,
                        eps_inside_sqrt=eps_inside_sqrt, weight_decay=weight_decay,
                        max_coeff=max_coeff, min_coeff=min_coeff)
        super().__init__(params, defaults)
        self.lamb_coeffs: list[torch.Tensor] = []

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:  # type: ignore[override]
        loss = _closure_loss(closure)
        self.lamb_coeffs = [self._update(param, group)
                            for group, param in _with_grads(self, "Lamb")]
        return loss

    def _update(self, param: torch.Tensor, group: Mapping[str, Any]) -> torch.Tensor:
        state = self.state[param]
        if not state:
            state["step"] = 0
            state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
        state["step"] += 1
        beta1, beta2 = group["betas"]
        grad, exp_avg, exp_avg_sq = param.grad, state["exp_avg"], state["exp_avg_sq"]
        exp_avg.mul_(beta1).add_(grad, alpha=1.0 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1.0 - beta2)
        step_size = group["lr"]
        if group["bias_correction"]:
            bc1, bc2 = 1.0 - beta1 ** state["step"], 1.0 - beta2 ** state["step"]
            step_size = step_size * math.sqrt(bc2) / bc1
        if group["eps_inside_sqrt"]:
            denom = exp_avg_sq.add(group["eps"]).sqrt_()
        else:
            denom = exp_avg_sq.sqrt().add_(group["eps"])
        update = exp_avg / denom
        if group["weight_decay"]:
            update.add_(param, alpha=group["weight_decay"])
        w_norm, u_norm = param.norm(), update.norm()
        trust = torch.where((w_norm > 0) & (u_norm > 0),
                            (w_norm / u_norm).clamp(group["min_coeff"], group["max_coeff"]),
                            torch.ones_like(w_norm))
        param.sub_(update.mul_(trust * step_size))
        return trust

    def get_lamb_coeffs(self) -> list[float]:
        return [float(coeff) for coeff in self.lamb_coeffs]


class Lion(Optimizer):
    """Lion (Chen et al. 2023, "Symbolic Discovery of Optimization
    Algorithms") as DeepSpeed's FusedLion / DeepSpeedCPULion compute it,
    per element::

        c = beta1 m + (1 - beta1) g
        w = w (1 - lr weight_decay) - lr sign(c)
        m = beta2 m + (1 - beta2) g

    Where ``c`` is exactly 0 (a gradient and momentum of zeros) the weight
    only decays: ``sign(0) = 0``, where DeepSpeed's kernels move it by
    ``lr`` in a direction their sign trick picks. Elementwise, so ZeRO
    stages shard it. DeepSpeed's defaults: ``lr=1e-3``, ``betas=(0.9, 0.999)``.
    """

    #: keep the momentum of 16-bit parameters in fp32 (DeepSpeedCPULion's default)
    fp32_states = False

    def __init__(self, params: Iterable[Any], lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), weight_decay: float = 0.0) -> None:
        if not (lr >= 0.0 and weight_decay >= 0.0 and len(betas) == 2
                and all(0.0 <= b < 1.0 for b in betas)):
            raise DsrunConfigError(f"Lion: invalid lr={lr}, betas={betas} or "
                                   f"weight_decay={weight_decay}")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:  # type: ignore[override]
        loss = _closure_loss(closure)
        for group, param in _with_grads(self, "Lion"):
            beta1, beta2 = group["betas"]
            state = self.state[param]
            if not state:
                dtype = torch.float32 if self.fp32_states else param.dtype
                state["step"] = 0
                state["exp_avg"] = torch.zeros_like(param, dtype=dtype,
                                                    memory_format=torch.preserve_format)
            state["step"] += 1
            exp_avg = state["exp_avg"]
            grad = param.grad.to(exp_avg.dtype)
            direction = exp_avg.mul(beta1).add_(grad, alpha=1.0 - beta1).sign_()
            if group["weight_decay"]:
                param.mul_(1.0 - group["lr"] * group["weight_decay"])
            param.add_(direction.to(param.dtype), alpha=-group["lr"])
            exp_avg.mul_(beta2).add_(grad, alpha=1.0 - beta2)
        return loss


# lower-case type -> torch class ("adam" picks Adam or AdamW from its params)
# (only the classes the installed torch has: Adafactor came with torch 2.5)
OPTIMIZER_CLASSES: Mapping[str, type[Optimizer]] = {
    "adam": torch.optim.AdamW, "adamw": torch.optim.AdamW, "lamb": Lamb, "lion": Lion,
    **{kind: getattr(torch.optim, name) for kind, name in OPTIMIZER_NAMES.items()
       if kind not in ("adam", "adamw", "lamb", "lion") and hasattr(torch.optim, name)},
}
ADAM_EXTRAS = ("adam_w_mode", "torch_adam", "bias_correction", "fp32_optimizer_states",
               "set_grad_none")
assert set(OPTIMIZER_CLASSES) <= set(OPTIMIZER_NAMES), "config and optimizers disagree on types"


def parameter_names(cls: type[Optimizer]) -> tuple[str, ...]:
    """Keyword parameters of an optimizer class, besides ``params``."""
    signature = inspect.signature(cls.__init__)
    return tuple(name for name, p in signature.parameters.items()
                 if name not in ("self", "params")
                 and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD))


def optimizer_class_and_kwargs(config: OptimizerConfig) -> tuple[type[Optimizer], dict[str, Any]]:
    """The torch class and keyword arguments ``config`` stands for (pure)."""
    kwargs = dict(config.params)
    if config.type not in OPTIMIZER_CLASSES:
        name = OPTIMIZER_NAMES[config.type]
        raise DsrunConfigError(f'optimizer.type "{name}": torch {torch.__version__} has no '
                               f"torch.optim.{name}; a newer torch has it")
    cls = OPTIMIZER_CLASSES[config.type]
    extras: tuple[str, ...] = ()
    if config.type in ("adam", "adamw", "lion"):
        # DeepSpeed's FusedAdam/FusedLion: zero_grad() sets gradients to None
        # (true) or calls torch's zero_grad, which sets them to None too
        _flag(kwargs.pop("set_grad_none", True), "set_grad_none")
    if config.type == "lion":
        extras = ("set_grad_none",)
    if config.type in ("adam", "adamw"):
        extras = ADAM_EXTRAS
        adam_w_mode = _flag(kwargs.pop("adam_w_mode", True), "adam_w_mode")
        torch_adam = _flag(kwargs.pop("torch_adam", False), "torch_adam")
        _flag(kwargs.pop("fp32_optimizer_states", True), "fp32_optimizer_states")
        if not _flag(kwargs.pop("bias_correction", True), "bias_correction"):
            raise DsrunConfigError('optimizer.params "bias_correction": false is not supported: '
                                   "torch's Adam/AdamW always correct bias")
        if config.type == "adam" and not adam_w_mode:
            cls = torch.optim.Adam
        if not torch_adam:
            kwargs.setdefault("weight_decay", 0.0)  # DeepSpeed FusedAdam's default
    for key, value in kwargs.items():  # an OptimizerConfig built without resolve()
        spec = OPTIMIZER_VALUES.get(key)
        if spec is not None and spec.kind == "bool" and not (value is None and spec.optional):
            _flag(value, key)
    valid = parameter_names(cls)
    for key in kwargs:
        if key not in valid:
            name = OPTIMIZER_NAMES[config.type]
            raise DsrunConfigError(
                f'unknown parameter "{key}" in optimizer.params for {name} '
                f"({cls.__module__}.{cls.__name__}){did_you_mean(key, (*valid, *extras))}; "
                f"valid: {', '.join((*valid, *extras))}")
    return cls, kwargs


def _flag(value: Any, name: str) -> bool:
    if not isinstance(value, bool):
        raise DsrunConfigError(f'optimizer.params "{name}" must be true or false, got {value!r}')
    return value


def build_optimizer(config: OptimizerConfig, params: Iterable[Any]) -> Optimizer:
    """Construct the optimizer over ``params`` (tensors or param-group dicts).

    A TypeError, ValueError, IndexError or KeyError of the constructor (torch's
    checks: an IndexError for a one-element ``betas`` ...) becomes a
    :class:`DsrunConfigError` naming ``optimizer.params`` and the config when
    the same params fail over one stand-in parameter too; otherwise it came
    from the script's ``params`` (a parameter in two groups, a group without
    "params") and propagates unchanged, as does any other exception."""
    cls, kwargs = optimizer_class_and_kwargs(config)
    if not isinstance(params, torch.Tensor):  # torch refuses a lone tensor itself
        params = list(params)  # a generator is read again by the stand-in probe
    try:
        return cls(params, **kwargs)
    except DsrunConfigError:
        raise
    except _ARGUMENT_ERRORS as err:
        if not _fails_with_kwargs(cls, kwargs, params):
            raise
        raise DsrunConfigError(
            f"optimizer {OPTIMIZER_NAMES[config.type]} ({cls.__module__}.{cls.__name__}) "
            f'rejected params {kwargs} ("optimizer.params" in {config.source}): '
            f"{type(err).__name__}: {err}") from err


_ARGUMENT_ERRORS = (TypeError, ValueError, IndexError, KeyError)


def _fails_with_kwargs(cls: type[Optimizer], kwargs: Mapping[str, Any], params: Any) -> bool:
    """Whether ``cls`` refuses ``kwargs`` over one stand-in parameter of the
    first real one's dtype and device (so the config, not the script's
    parameters, is what it refused)."""
    like = _first_tensor(params)
    floating = like is not None and (like.is_floating_point() or like.is_complex())
    stand_in = torch.nn.Parameter(torch.zeros(
        1, dtype=like.dtype if floating else torch.float32,
        device=like.device if like is not None else "cpu"))
    try:
        cls([stand_in], **kwargs)
    except _ARGUMENT_ERRORS:
        return True
    except Exception:  # noqa: BLE001 - another failure: not a verdict on kwargs
        return False
    return False


def _first_tensor(value: Any, depth: int = 0) -> Optional[torch.Tensor]:
    """The first tensor in params, param-group dicts or (name, tensor) pairs."""
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, Mapping):
        value = value.get("params")
    if depth < 3 and isinstance(value, (list, tuple)):
        for item in value:
            found = _first_tensor(item, depth + 1)
            if found is not None:
                return found
    return None
