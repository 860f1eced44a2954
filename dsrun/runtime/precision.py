"""Numeric precision of training: what the model computes in, what the
optimizer updates, and how a step is checked and applied.

* :class:`FullPrecision` (fp32): the optimizer updates the model's own
  parameters; ``gradient_clipping`` clips their global norm.
* :class:`BF16Autocast` (``bf16.enabled``): parameters, gradients and
  optimizer state stay fp32 - the parameters *are* the fp32 master weights
  (a model handed over in bf16 or fp16 is upcast at stage 0) - and the
  forward runs under ``torch.autocast(device, dtype=bfloat16)`` (on CPU
  ``torch.autocast('cpu', ...)``). bf16 has fp32's range: no loss
  scaling, but a non-finite gradient norm skips the step
  (``bf16.check_grad_overflow``, true by default as in DeepSpeed).
* :class:`FP16Master` (``fp16.enabled``): as DeepSpeed does, the module's
  parameters are converted to fp16 (its floating buffers follow
  ``data_types``, :mod:`~dsrun.runtime.buffer_dtypes`: by default they keep
  their dtype; the script feeds fp16 inputs, or sets ``fp16.auto_cast`` to
  have floating-point inputs cast), and the optimizer updates fp32 master
  copies. The loss is multiplied by the loss scale before backward; at a
  step the fp16 gradients are unscaled into the masters' fp32 gradients,
  and a non-finite global norm is an overflow: the step is skipped and
  :class:`LossScaler` shrinks the scale. Otherwise the masters are
  clipped, stepped and copied back into the fp16 model. This is real fp16
  arithmetic on every device, CPU included (slow there, but correct:
  overflows are the ones a GPU run would see).

* :class:`TorchAutocast` / :class:`TorchAutocastFP16` (the
  ``torch_autocast`` section): fp32 weights, the forward under a bfloat16 or
  float16 autocast; float16 scales the loss with ``torch.amp.GradScaler``'s
  rule (:class:`GradScalerRule`).

With a model-parallel ``mpu`` (:attr:`FullPrecision.model_parallel`, set by
the engine when its model-parallel size is above 1) the norm is the whole
model's, reduced over the model-parallel group with each parameter counted
once (:func:`~dsrun.runtime.norms.clip_model_parallel_`): every
tensor-parallel rank clips by the same coefficient and skips the same steps.

A precision's :meth:`step` returns a :class:`StepResult`; the engine does the
bookkeeping (counters, LR scheduler, logs). A skipped step (fp16 overflow,
or a non-finite norm where :attr:`FullPrecision.skips_nonfinite`) reports
the norm as ``inf``, as DeepSpeed does. That contract and the precisions
without loss scaling (fp32, bf16, bfloat16 ``torch_autocast``) are in
:mod:`dsrun.runtime.precision_base`, whose names are importable from here.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Iterable, Sequence
from typing import Any, Optional

import torch
from torch.optim import Optimizer
from torch.utils.hooks import RemovableHandle

from dsrun.errors import DsrunConfigError
from dsrun.runtime.buffer_dtypes import CASTABLE, apply_buffer_rules
from dsrun.runtime.config import DTYPE_NAMES, DsrunConfig
from dsrun.runtime.loss_scaler import LossScaler
from dsrun.runtime.norms import ModelParallel, clip_model_parallel_
from dsrun.runtime.precision_base import (  # noqa: F401 - importable from here as before
    INF,
    BF16Autocast,
    FullPrecision,
    StepResult,
    TorchAutocast,
    global_norm,
    skipped,
)

log = logging.getLogger(__name__)


class TorchAutocastFP16(TorchAutocast):
    """``torch_autocast`` with float16: fp32 weights, the forward under a
    float16 autocast, and the loss scaled as ``torch.amp.GradScaler``
    scales it (DeepSpeed uses one for this section): from 2^16, halved on
    every overflow (the step is skipped), doubled after 2000 clean steps in
    a row. Gradients are fp32 and unscaled in place before the step."""

    name = "autocast-fp16"
    reports_norm = True

    def __init__(self, params: Sequence[torch.nn.Parameter], names: Sequence[str],
                 device: torch.device) -> None:
        super().__init__(params, names, device)
        self.scaler = GradScalerRule()

    @property
    def loss_scale(self) -> float:
        return self.scaler.scale

    def autocast(self) -> Any:
        return torch.autocast(self.device.type, dtype=torch.float16)

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        self.take_written_scale()
        return loss.float() * self.scaler.scale

    @torch.no_grad()
    def unscaled_grads(self) -> list[tuple[torch.nn.Parameter, Optional[torch.Tensor]]]:
        """This rank's gradients, divided by the loss scale in place."""
        inverse = 1.0 / self.scaler.scale
        for param in self.params:
            if param.grad is not None:
                param.grad.mul_(inverse)
        return super().unscaled_grads()

    def step(self, optimizer: Optimizer, max_norm: float) -> StepResult:
        self.unscaled_grads()
        return _scaled_step(self.scaler, optimizer, self.params, max_norm, self.params,
                            self.model_parallel)


class GradScalerRule(LossScaler):
    """:class:`LossScaler` with ``torch.amp.GradScaler``'s default rule:
    scale 2^16, halved on every overflow (no hysteresis, no floor), doubled
    at every 2000th clean step in a row."""

    def __init__(self) -> None:
        super().__init__(scale=2.0**16, dynamic=True, window=2000, hysteresis=1,
                         min_scale=0.0, raise_at_min_scale=False)

    def _on_clean(self) -> None:
        if (self.iteration - self.last_overflow_iteration) % self.window == 0:
            self.scale *= self.scale_factor


class FP16Scaling(FullPrecision):
    """fp16 model and loss scaling, without master weights of its own: what
    the ZeRO stages use, whose optimizer keeps fp32 partitions as masters."""

    name = "fp16"
    reports_norm = True

    def __init__(self, params: Sequence[torch.nn.Parameter], names: Sequence[str],
                 device: torch.device, config: DsrunConfig) -> None:
        super().__init__(params, names, device)
        fp16 = config.fp16
        self.auto_cast = fp16.auto_cast
        dynamic = fp16.dynamic_loss_scale
        self.scaler = LossScaler(
            scale=fp16.initial_dynamic_scale if dynamic else fp16.loss_scale, dynamic=dynamic,
            window=fp16.loss_scale_window, hysteresis=fp16.hysteresis,
            consecutive_hysteresis=fp16.consecutive_hysteresis,
            min_scale=fp16.min_loss_scale if dynamic else 1.0)

    @staticmethod
    @torch.no_grad()
    def convert_module(module: torch.nn.Module) -> None:
        """The model's floating parameters become fp16, keeping their identity
        (``p.data`` is replaced); buffers are left to
        :func:`~dsrun.runtime.buffer_dtypes.apply_buffer_rules`, as DeepSpeed
        casts parameters only."""
        for param in module.parameters():
            if param.dtype in CASTABLE and param.dtype != torch.float16:
                param.data = param.data.half()

    @property
    def loss_scale(self) -> float:
        return self.scaler.scale

    def hook_input_cast(self, module: torch.nn.Module) -> Optional[RemovableHandle]:
        if not self.auto_cast:
            return None
        return module.register_forward_pre_hook(lambda _, args: self.cast_inputs(args))

    def cast_inputs(self, value: Any) -> Any:
        if not self.auto_cast:
            return value
        if isinstance(value, torch.Tensor):
            return value.half() if value.is_floating_point() else value
        if isinstance(value, (list, tuple)):
            return type(value)(self.cast_inputs(v) for v in value)
        if isinstance(value, dict):
            return {k: self.cast_inputs(v) for k, v in value.items()}
        return value

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        self.take_written_scale()
        return loss.float() * self.scaler.scale


class FP16Master(FP16Scaling):
    """fp16 model, fp32 master weights, dynamic or static loss scale."""

    def __init__(self, params: Sequence[torch.nn.Parameter], names: Sequence[str],
                 device: torch.device, config: DsrunConfig,
                 frozen: Sequence[tuple[str, torch.nn.Parameter]] = ()) -> None:
        super().__init__(params, names, device, config)
        self.masters = [torch.nn.Parameter(p.detach().float().clone()) for p in self.params]
        self._master_of = {id(p): m for p, m in zip(self.params, self.masters)}
        #: the module's parameters frozen at initialize(): a master only when
        #: handed to the optimizer (they train once unfrozen, as DeepSpeed's
        #: fp16 optimizer flattens every parameter of its groups)
        self._frozen = {id(p): (n, p) for n, p in frozen}
        #: ids of the parameters seen frozen (at a step, or handed over
        #: frozen): while frozen the fp16 parameter is the value (anything
        #: may write it), so the master follows it when it trains again
        self._stale: set[int] = set()

    def optimizer_params(self, source: Iterable[Any]) -> list[Any]:
        """The masters of the parameters handed over (frozen ones too: they
        train once unfrozen, as in fp32)."""
        out: list[Any] = []
        for item in source:
            if isinstance(item, dict):
                out.append({**item, "params": [self._master(p)
                                               for p in _as_list(item["params"])]})
            else:
                out.append(self._master(item))
        return out

    def track(self, module: torch.nn.Module, optimizer: Optimizer) -> list[torch.nn.Parameter]:
        """The model's fp16 parameters put into ``optimizer`` after
        initialize() (``add_param_group``) are replaced there by their fp32
        masters, made now for those frozen at initialize(): they join the
        unscale, overflow check, clipping, norms and all-reduce, as the
        others (at initialize() :meth:`_master` covered each). -> the
        parameters newly covered."""
        masters = {id(m) for m in self.masters}
        held = {id(t) for g in optimizer.param_groups for t in g["params"]}
        swaps: list[tuple[list[Any], int, torch.Tensor]] = []
        swapped: set[int] = set()
        for g, group in enumerate(optimizer.param_groups):  # checked before anything changes
            for i, tensor in enumerate(group["params"]):
                if id(tensor) in masters:
                    continue
                where = f"param group {g}, parameter {i} (shape {tuple(tensor.shape)})"
                if id(tensor) not in self._master_of and id(tensor) not in self._frozen:
                    raise DsrunConfigError(
                        f"optimizer.add_param_group: {where} is not a parameter of the model "
                        "passed to initialize(); with fp16 enabled the optimizer steps fp32 "
                        "masters of the model's parameters only")
                master = self._master_of.get(id(tensor))
                if (master is not None and id(master) in held) or id(tensor) in swapped:
                    raise DsrunConfigError(f"optimizer.add_param_group: {where} is in the "
                                           "optimizer already")
                swapped.add(id(tensor))
                swaps.append((group["params"], i, tensor))
        before = len(self.params)
        for tensors, i, tensor in swaps:
            tensors[i] = self._master(tensor)
        return self.params[before:]

    def _master(self, param: torch.Tensor) -> torch.Tensor:
        master = self._master_of.get(id(param))
        if master is None and id(param) in self._frozen:
            name, _ = self._frozen.pop(id(param))
            master = torch.nn.Parameter(param.detach().float().clone())
            self._stale.add(id(param))
            self.params.append(param)  # clipping, norms, gradient all-reduce, copy-back
            self.names.append(name)
            self.masters.append(master)
            self._master_of[id(param)] = master
        if master is None:
            raise DsrunConfigError("with fp16 enabled, the optimizer's parameters must be "
                                   "parameters of the model passed to initialize()")
        return master

    def optimizer_tensor(self, param: torch.Tensor) -> torch.Tensor:
        return self._master_of.get(id(param), param)

    @torch.no_grad()
    def sync_from_optimizer(self, param: torch.Tensor) -> None:
        master = self._master_of.get(id(param))
        if master is not None:
            param.copy_(master)

    def full_value(self, param: torch.Tensor) -> torch.Tensor:
        """The master of ``param``; for a parameter frozen now, the parameter
        itself (upcast) where it was written since its master was made."""
        master = self._master_of.get(id(param))
        if master is None:
            return param
        return master if param.requires_grad else _following(param, master)

    def adopt(self, optimizer: Optimizer) -> None:
        """Point a client-built optimizer at the fp32 masters (DeepSpeed's FP16 wrapper)."""
        if optimizer.state:
            raise DsrunConfigError("with fp16 enabled, pass an optimizer that has not stepped "
                                   "yet: dsrun moves it onto fp32 master weights")
        for group in optimizer.param_groups:
            group["params"] = [self._master(p) for p in group["params"]]

    @torch.no_grad()
    def unscaled_grads(self) -> list[tuple[torch.nn.Parameter, Optional[torch.Tensor]]]:
        """Each parameter with its master's gradient: its own, unscaled into
        fp32. A parameter with a gradient again after being frozen first has
        its master follow the value it holds."""
        inverse = 1.0 / self.scaler.scale
        for param, master in zip(self.params, self.masters):
            if not param.requires_grad:
                self._stale.add(id(param))
            elif param.grad is not None and id(param) in self._stale:
                self._stale.discard(id(param))
                master.copy_(_following(param, master))
            master.grad = None if param.grad is None else param.grad.float().mul_(inverse)
        return [(param, master.grad) for param, master in zip(self.params, self.masters)]

    def step(self, optimizer: Optimizer, max_norm: float) -> StepResult:
        self.unscaled_grads()
        result = _scaled_step(self.scaler, optimizer, self.masters, max_norm, self.params,
                              self.model_parallel)
        if result.applied:
            self.copy_back()
        return result

    @torch.no_grad()
    def copy_back(self) -> None:
        """After an applied step: the stepped masters (those with a gradient)
        into their parameters. A master without one was not stepped (torch
        optimizers skip it), and a frozen parameter keeps what it holds."""
        for param, master in zip(self.params, self.masters):
            if master.grad is not None:
                param.copy_(master)

    def zero_grad(self) -> None:
        super().zero_grad()
        for master in self.masters:
            master.grad = None


def _scaled_step(scaler: LossScaler, optimizer: Optimizer, owners: Sequence[torch.Tensor],
                 max_norm: float, params: Sequence[torch.Tensor],
                 model_parallel: Optional[ModelParallel]) -> StepResult:
    """The step of a loss-scaling precision once its gradients (those of
    ``owners``, the optimizer's tensors of the model's ``params``) are
    unscaled: clip or measure their norm, skip the step on a non-finite one
    (the scaler decides the scale), else step."""
    with_grad = [t for t in owners if t.grad is not None]
    if model_parallel is not None:  # ``params`` carry the tensor-parallel marks
        pairs = [(p, t.grad) for p, t in zip(params, owners) if t.grad is not None]
        norm = clip_model_parallel_(pairs, max_norm, model_parallel)
    elif max_norm > 0:
        norm = torch.nn.utils.clip_grad_norm_(with_grad, max_norm)
    else:
        norm = global_norm([t.grad for t in with_grad])
    overflow = not bool(torch.isfinite(norm))
    if scaler.update(overflow):
        return skipped(norm)
    optimizer.step()
    return StepResult(True, norm)


def _following(param: torch.Tensor, master: torch.Tensor) -> torch.Tensor:
    """``master``, or ``param`` upcast where it no longer rounds to it (it was
    written since): kept fp32 digits are not thrown away for nothing."""
    if torch.equal(master.to(param.dtype), param):
        return master
    return param.detach().to(master.dtype)


def _as_list(params: Any) -> list[Any]:
    return [params] if isinstance(params, torch.Tensor) else list(params)


def make_precision(config: DsrunConfig, module: torch.nn.Module,
                   device: torch.device, masters: bool = True) -> FullPrecision:
    """The precision ``config`` asks for; fp16 converts ``module``'s parameters
    first (and bf16 at stage 0 upcasts 16-bit ones), and the buffers get the
    dtypes ``data_types`` gives them. ``masters`` False: the
    optimizer keeps fp32 masters itself (ZeRO)."""
    precision = _make_precision(config, module, device, masters)
    if precision.scaler is None:
        precision.skips_nonfinite = config.bf16.check_grad_overflow if config.bf16.enabled \
            else not masters
    return precision


def _make_precision(config: DsrunConfig, module: torch.nn.Module,
                    device: torch.device, masters: bool) -> FullPrecision:
    if config.fp16.enabled:
        FP16Master.convert_module(module)
    apply_buffer_rules(module, config)
    if config.bf16.enabled and masters:
        upcast = BF16Autocast.convert_module(module)
        if upcast:
            log.info("bf16 at ZeRO stage 0: %d parameter(s) of the model (%s%s) upcast to fp32 "
                     "to be the master weights; the forward runs under a bfloat16 autocast",
                     len(upcast), ", ".join(upcast[:3]), ", ..." if len(upcast) > 3 else "")
    named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
    names, params = [n for n, _ in named], [p for _, p in named]
    if config.fp16.enabled and masters:
        frozen = [(n, p) for n, p in module.named_parameters() if not p.requires_grad]
        return FP16Master(params, names, device, config, frozen)
    if config.fp16.enabled:
        return FP16Scaling(params, names, device, config)
    if config.bf16.enabled:
        return BF16Autocast(params, names, device)
    autocast = config.torch_autocast
    if autocast.enabled:
        _check_importable(autocast.lower_precision_safe_modules or ())
        half = autocast.torch_dtype(device.type) == "float16"
        if not masters:
            _note_autocast_reduction(config, module, autocast.torch_dtype(device.type))
        return (TorchAutocastFP16 if half else TorchAutocast)(params, names, device)
    return FullPrecision(params, names, device)


def _note_autocast_reduction(config: DsrunConfig, module: torch.nn.Module, dtype: str) -> None:
    """Say once (rank 0) where ZeRO's ``torch_autocast`` gradient reduction
    differs from DeepSpeed 0.19.8's, a deliberate difference (README, "Where
    dsrun and DeepSpeed 0.19.8 give different numbers on purpose").

    DeepSpeed's ZeRO 1-3 reduce the parameters of modules whose class is
    exactly one of ``lower_precision_safe_modules`` (default: Linear,
    Conv1d-3d) in the autocast dtype and every other one in fp32, whatever
    ``communication_data_type`` says; dsrun reduces all of them in
    ``communication_data_type``, else fp32 (what plain data parallelism
    gives)."""
    if torch.distributed.is_initialized() and torch.distributed.get_rank() != 0:
        return
    from dsrun.runtime.engine_info import LOWER_PRECISION_SAFE_MODULES  # it imports this module

    names = config.torch_autocast.lower_precision_safe_modules
    classes = LOWER_PRECISION_SAFE_MODULES if names is None else tuple(
        getattr(importlib.import_module(n.rpartition(".")[0]), n.rpartition(".")[2])
        for n in names)
    safe = {id(p) for m in module.modules() if type(m) in classes
            for p in m.parameters(recurse=False)}
    trained = [p for p in module.parameters() if p.requires_grad]
    n_safe = sum(id(p) in safe for p in trained)
    comm = DTYPE_NAMES[config.communication_data_type or "fp32"]
    if not ((n_safe and comm != dtype) or (len(trained) > n_safe and comm != "float32")):
        return
    short = {"bfloat16": "bf16", "float16": "fp16"}[dtype]
    hint = f'; "communication_data_type": "{short}" reduces as DeepSpeed does here' \
        if n_safe == len(trained) else ""
    log.info("torch_autocast at ZeRO stage %d: DeepSpeed 0.19.8 reduces the gradients of %d "
             "parameter(s) in lower_precision_safe_modules (%s) in %s and of the other %d in "
             "float32; dsrun reduces all of them in %s, so the numbers differ by that "
             "rounding%s", config.zero_optimization.stage, n_safe,
             "Linear, Conv1d-3d" if names is None else ", ".join(names), dtype,
             len(trained) - n_safe, comm, hint)


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a config's dtype name (DeepSpeed's DtypeEnum
    spellings: ``"bf16"``, ``"torch.float16"``, ``"float"`` ...)."""
    return getattr(torch, DTYPE_NAMES[name])

def _check_importable(class_names: Iterable[str]) -> None:
    """Each dotted name names a class (DeepSpeed imports them too)."""
    for dotted in class_names:
        module_name, _, attr = dotted.rpartition(".")
        try:
            found = getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError) as err:
            raise DsrunConfigError(f"torch_autocast.lower_precision_safe_modules: cannot import "
                                   f"{dotted!r}: {err}") from None
        if not isinstance(found, type):
            raise DsrunConfigError(f"torch_autocast.lower_precision_safe_modules: {dotted!r} is "
                                   "not a class")
