"""The contract every training precision follows, and the precisions that
do not scale the loss.

A precision's ``step`` returns a :class:`StepResult`; a step skipped for a
non-finite gradient is :func:`skipped` (its norm reads ``inf``, as in
DeepSpeed). :class:`FullPrecision` is fp32 training and the base class of
every precision: the optimizer updates the model's own parameters and
``gradient_clipping`` clips their global norm (over the model-parallel
group too, when the engine sets :attr:`FullPrecision.model_parallel`).
:class:`TorchAutocast` (``torch_autocast`` with bfloat16) and
:class:`BF16Autocast` (dsrun's ``bf16``) keep fp32 weights and run the
forward under a bfloat16 autocast. The loss-scaling precisions (fp16) and
the factory that picks one from a config are in
:mod:`dsrun.runtime.precision`, which re-exports these names.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch.optim import Optimizer
from torch.utils.hooks import RemovableHandle

from dsrun.runtime import sparse_grads
from dsrun.runtime.buffer_dtypes import HALF_DTYPES
from dsrun.runtime.loss_scaler import LossScaler, checked_scale
from dsrun.runtime.norms import ModelParallel, clip_model_parallel_


@dataclass(frozen=True)
class StepResult:
    applied: bool
    grad_norm: Optional[torch.Tensor] = None  # before clipping; None when not computed
    #: a non-finite gradient (fp16 overflow, or a non-finite norm where the
    #: precision skips those): the step was skipped
    overflow: bool = False


INF = float("inf")


def skipped(norm: Optional[torch.Tensor] = None) -> StepResult:
    """A step skipped for a non-finite gradient: its norm reads ``inf`` (as
    DeepSpeed reports it), a NaN one included."""
    device = norm.device if norm is not None else None
    return StepResult(False, torch.tensor(INF, device=device), True)


def global_norm(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """L2 norm of all ``tensors`` together, in fp32 (a sparse one by its values)."""
    if not tensors:
        return torch.zeros(())
    return sparse_grads.grad_norm(tensors)


class FullPrecision:
    """fp32 training (module docstring)."""

    name = "fp32"
    #: the step always measures the global gradient norm (DeepSpeed reports
    #: it then); otherwise only with clipping
    reports_norm = False
    #: the loss scaler of a loss-scaling precision
    scaler: Optional[LossScaler] = None
    #: without a loss scaler: a non-finite global gradient norm skips the
    #: step (DeepSpeed's rule: fp32 at ZeRO 1-3 and bf16 with
    #: ``check_grad_overflow``; plain fp32 at stage 0 steps, as torch does)
    skips_nonfinite = False
    #: the mpu's model-parallel group when it has more than one rank (the
    #: engine sets it): the norm is reduced over it too (module docstring)
    model_parallel: Optional[ModelParallel] = None
    #: stage 0 (:meth:`publish_scale`): the torch optimizer initialize()
    #: returned, which carries DeepSpeed's fp16-wrapper ``loss_scale`` and
    #: ``cur_scale`` as plain attributes, and the value last put there
    _mirror: Optional[Any] = None
    _mirrored: Any = None

    def __init__(self, params: Sequence[torch.nn.Parameter], names: Sequence[str],
                 device: torch.device) -> None:
        self.params = list(params)
        self.names = list(names)
        self.device = device
        #: ids of the parameters trainable at initialize() (the stage-0
        #: ``safe_get_*`` rule: a parameter frozen then and still frozen has
        #: no trained state, as at stages 1-3)
        self.trainable_at_start = frozenset(id(p) for p in self.params)

    @property
    def loss_scale(self) -> float:
        return 1.0

    def publish_scale(self, optimizer: Any) -> None:
        """Stage 0: ``optimizer.cur_scale``/``loss_scale`` = the scale in use
        (plain attributes: the optimizer is the client's torch one, where
        DeepSpeed returns its fp16 wrapper) and ``optimizer.loss_scaler`` =
        the scaler where it has none; :meth:`take_written_scale` makes a
        script's write to them the scale used."""
        scale = float(self.loss_scale)
        optimizer.cur_scale = optimizer.loss_scale = scale
        self._mirror, self._mirrored = optimizer, scale
        if self.scaler is not None:
            # a write to loss_scaler.cur_scale shows on the optimizer at once
            self.scaler.on_write = self._scale_written
            if not hasattr(optimizer, "loss_scaler"):
                optimizer.loss_scaler = self.scaler

    def _scale_written(self) -> None:
        """The scaler's ``cur_scale`` was written: the stage-0 optimizer's
        ``cur_scale``/``loss_scale`` show it (the latest write wins over an
        earlier one to the optimizer's own attributes)."""
        if self._mirror is not None:
            self.publish_scale(self._mirror)

    def take_written_scale(self) -> None:
        """Before a backward, a step (the engine's, for every step path) or a
        checkpoint save or load: a value a script wrote to the stage-0
        optimizer's ``loss_scale`` or ``cur_scale`` since :meth:`publish_scale`
        becomes the scaler's scale (DeepSpeed's FP16_Optimizer setter), and a
        scale set through ``loss_scaler.cur_scale`` is mirrored there. A few
        attribute reads: nothing is published at ZeRO 1-3, whose optimizer
        reads and writes the scaler itself."""
        mirror, scaler = self._mirror, self.scaler
        if mirror is None or scaler is None:
            return
        published = self._mirrored
        values = vars(mirror)
        for name in ("loss_scale", "cur_scale"):
            value = values.get(name, published)
            if value != published:
                scaler.scale = checked_scale(value, f"optimizer.{name}")
                break
        else:
            if scaler.scale == published:
                return
        self.publish_scale(mirror)

    def autocast(self) -> Any:
        return contextlib.nullcontext()

    def cast_inputs(self, value: Any) -> Any:
        return value

    def hook_input_cast(self, module: torch.nn.Module) -> Optional[RemovableHandle]:
        """Cast what :meth:`cast_inputs` casts in ``module``'s positional
        arguments, before every call of it (DeepSpeed's ``fp16.auto_cast``
        pre-hook: ``engine.module(x)`` and ``generate`` calls are cast too,
        keyword arguments are not); None where nothing is cast."""
        return None

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss

    def optimizer_params(self, source: Iterable[Any]) -> list[Any]:
        """What to build an optimizer over, given the client's model_parameters
        (frozen ones too, as torch's optimizers take them: they train once
        unfrozen at stage 0; the ZeRO stages leave out what is frozen at
        initialize())."""
        return list(source)

    def track(self, module: torch.nn.Module, optimizer: Optimizer) -> list[torch.nn.Parameter]:
        """Also cover (clipping, norms, gradient all-reduce) the parameters of
        ``module`` in ``optimizer`` that were frozen when this was built
        (at initialize(), and again for a group added later with
        ``add_param_group``); -> those newly covered."""
        known = {id(p) for p in self.params}
        held = {id(p) for g in optimizer.param_groups for p in g["params"]}
        added = []
        for name, param in module.named_parameters():
            if id(param) in held and id(param) not in known:
                known.add(id(param))
                self.params.append(param)
                self.names.append(name)
                added.append(param)
        return added

    def adopt(self, optimizer: Optimizer) -> None:
        """Prepare a client-built optimizer (nothing to do in fp32)."""

    def optimizer_tensor(self, param: torch.Tensor) -> torch.Tensor:
        """The tensor the optimizer updates for model parameter ``param``
        (the parameter itself here; its fp32 master under fp16)."""
        return param

    def sync_from_optimizer(self, param: torch.Tensor) -> None:
        """After ``optimizer_tensor(param)`` was overwritten (a checkpoint
        load): make ``param`` follow it (nothing to do here)."""

    def full_value(self, param: torch.Tensor) -> torch.Tensor:
        """The value to save and report for ``param`` (its optimizer tensor)."""
        return self.optimizer_tensor(param)

    def step(self, optimizer: Optimizer, max_norm: float) -> StepResult:
        norm = None
        measured = max_norm > 0 or self.reports_norm or self.skips_nonfinite
        if self.model_parallel is not None and measured:
            pairs = [(p, p.grad) for p in self.params if p.grad is not None]
            norm = clip_model_parallel_(pairs, max_norm, self.model_parallel)
        elif max_norm > 0:  # sparse embedding gradients too (stage 0, fp32)
            norm = sparse_grads.clip_grad_norm_(self.params, max_norm)
        elif self.reports_norm or self.skips_nonfinite:
            norm = global_norm([p.grad for p in self.params if p.grad is not None])
        if self.skips_nonfinite and norm is not None and not bool(torch.isfinite(norm)):
            return skipped(norm)
        optimizer.step()
        return StepResult(True, norm)

    def unscaled_grads(self) -> list[tuple[torch.nn.Parameter, Optional[torch.Tensor]]]:
        """Each parameter with the gradient its optimizer steps on, divided by
        the loss scale where there is one (ZeRO stage 0 and pipelines)."""
        return [(param, param.grad) for param in self.params]

    def zero_grad(self) -> None:
        for param in self.params:
            param.grad = None

    def first_bad_param(self) -> Optional[str]:
        """Name of the first parameter whose gradient has an inf/NaN (before zero_grad)."""
        for name, param in zip(self.names, self.params):
            if param.grad is not None and not bool(torch.isfinite(param.grad).all()):
                return name
        return None


class TorchAutocast(FullPrecision):
    """The ``torch_autocast`` section with a bfloat16 dtype: fp32 weights,
    gradients and optimizer state, the forward under ``torch.autocast``
    (what dsrun's ``bf16`` does too, under another name)."""

    name = "autocast-bf16"

    def autocast(self) -> Any:
        return torch.autocast(self.device.type, dtype=torch.bfloat16)


class BF16Autocast(TorchAutocast):
    """dsrun's ``bf16``: the bfloat16 autocast of :class:`TorchAutocast`, with
    the norm measured also without clipping (DeepSpeed's bf16 optimizer
    always computes it)."""

    name = "bf16"
    reports_norm = True

    @staticmethod
    @torch.no_grad()
    def convert_module(module: torch.nn.Module) -> list[str]:
        """Stage 0: the parameters are the fp32 masters, so a model handed
        over in a 16-bit dtype is upcast (its parameters keep their
        identity; the forward still runs in bf16 under the autocast).
        Returns the names of the parameters upcast."""
        upcast = []
        for name, param in module.named_parameters():  # a tied parameter is listed once
            if param.dtype in HALF_DTYPES:
                param.data = param.data.float()
                upcast.append(name)
        return upcast
