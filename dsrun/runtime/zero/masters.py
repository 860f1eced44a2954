"""What every ZeRO stage does the same way on its fp32 master partitions.

:class:`MasterGradients` is the shared base of the stage 1/2
(:class:`~.sharded.ZeroOptimizer`) and stage 3 (:class:`~.stage3.ZeroStage3`)
optimizers: fp16 unscaling, the overflow check every rank agrees on, the
global gradient norm computed from the partitions, and torch's clipping
rule. A subclass provides ``masters`` (flat fp32 tensors whose ``.grad``
holds this rank's partition of the mean gradient after
:meth:`reduce_gradients`), ``optimizer`` (the inner torch optimizer),
``group``, ``world_size`` and ``comm_device`` (where the group's backend
reduces: the masters may be in host memory under ``offload_optimizer``);
it may override :meth:`_all_reduce` to announce each collective (stage 3's
divergence guard).

**The inner optimizer** (:func:`inner_kwargs`) runs torch's fastest
implementation over few large tensors: ``fused=True`` for ``torch.optim.Adam``
/ ``AdamW`` (one kernel per tensor on CUDA and on the CPU, no temporaries;
measured on this 2-core machine, one thread, 20M elements: fused 13.5 ms,
foreach 100 ms, single-tensor in 1M pieces 51 ms, whole 140 ms), else
``foreach=True`` - unless the client chose either itself, which is kept.
Fused Adam is elementwise: stepping a flat master equals stepping each
parameter bitwise (checked in the tests), but it rounds differently from
torch's single-tensor Adam (about 1 ulp per step), the CPU default.

**Sub-groups.** With a non-fused implementation on host memory the inner
optimizer steps each master in pieces of at most ``sub_group_size``
elements (DeepSpeed's knob of that name; :data:`HOST_PIECE` when unset):
each piece is a ``Parameter`` that is a view of the master, its gradient a
view of the master's ``.grad`` (bound by :meth:`_step_inner`). Elementwise
optimizers give the same values bitwise; what changes is the size of the
optimizer's temporaries (Adam's ``sqrt`` of the whole second moment, ...):
host allocations above glibc's mmap threshold (32 MiB at most) are returned
to the kernel when freed and page-faulted in again on every step, which on
the bench model cost more than the optimizer's arithmetic. Fused steps make
no temporaries, and on a GPU whole tensors are fastest: there the masters
are stepped whole unless ``sub_group_size`` is given.

**fp16 overflow under accumulation.** Where gradients are reduced during
backward (stages 2-3 at world size > 1, or with offload), each micro-step's
reduced fp16 gradient is added into the fp32 partition accumulators: a sum
beyond float16's range stays finite there. DeepSpeed (and dsrun's own flat
float16 gradients) accumulate in float16, where it becomes inf and the step
is skipped. :meth:`MasterGradients.has_overflow` therefore tests the scaled
sums against the model dtype's range (:attr:`~MasterGradients.grad_dtype`,
:func:`overflow_limit`): a value that would round to inf in float16 is an
overflow, so every stage, world size and offload setting skips the same steps.

**Model parallelism.** With an mpu whose model-parallel size is above 1
(:attr:`MasterGradients.model_parallel`) the overflow flag and the norm are
reduced over its model-parallel group too, after the data-parallel
reduction, as DeepSpeed's ZeRO optimizers do: a partition mixes replicated
and tensor-parallel parameters, so the squares are summed per parameter
piece (:meth:`~MasterGradients._param_slices`), a replicated piece only on
tensor-parallel rank 0 (:class:`~dsrun.runtime.norms.ModelParallel`).
Without one the flat masters are reduced whole, as before.

**Offload.** When the masters live in host memory and the parameters on a
GPU, the step goes piece by piece (:data:`OFFLOAD_PIECE` elements unless
``sub_group_size`` is given): the host steps a piece, issues its
``non_blocking`` copy back to the GPU (:meth:`_step_inner`'s ``publish``),
and steps the next piece while that copy runs.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from dsrun import comm as collectives
from dsrun.errors import DsrunError
from dsrun.runtime.loss_scaler import LossScaler, UnitLossScaler, checked_scale
from dsrun.runtime.norms import CLIP_EPS, ModelParallel, split_squares
from dsrun.runtime.zero.inner_impl import (  # noqa: F401 - importable from here, as before
    FUSED_CLASSES,
    HOST_PIECE,
    OFFLOAD_PIECE,
    fused_devices,
    inner_kwargs,
    piece_size,
    split_master,
)
from dsrun.runtime.zero.offload import Placement
from dsrun.runtime.zero.ownership import Owner


def overflow_limit(dtype: Optional[torch.dtype]) -> float:
    """The smallest magnitude that rounds to inf in ``dtype`` (round to
    nearest: its largest finite value plus half a unit in the last place;
    65520 for float16); inf for None and for dtypes as wide as the fp32
    accumulators, where only inf and NaN are out of range."""
    if dtype is None or not dtype.is_floating_point or dtype.itemsize >= 4:
        return math.inf
    info = torch.finfo(dtype)
    top_exponent = math.frexp(info.max)[1] - 1
    return info.max + info.eps * 2.0 ** top_exponent / 2


def in_range(grads: list[torch.Tensor], limit: float) -> torch.Tensor:
    """A 0-d bool tensor on the gradients' device (no host sync): every
    element of ``grads`` is below ``limit`` in magnitude - inf and NaN never
    are (one min/max pass per tensor, no temporary of the tensor's size)."""
    checks = []
    for grad in grads:
        low, high = torch.aminmax(grad)  # NaN propagates into both
        checks.append(torch.logical_and(high < limit, low > -limit))
    return torch.stack(checks).all()


def reduce_on_device(value: torch.Tensor, op: Any, group: Any, device: torch.device) -> None:
    """All-reduce ``value`` in place through ``device`` (the backend's: a
    NCCL group cannot reduce host tensors, which offloaded masters are)."""
    if value.device == device:
        collectives.all_reduce(value, op=op, group=group)
        return
    staged = value.to(device)
    collectives.all_reduce(staged, op=op, group=group)
    value.copy_(staged)


class MasterGradients(Owner):
    masters: list[torch.nn.Parameter]
    # per master: the next reduction writes each element by copy (no
    # zeroing needed after a step), until its first round has ended
    _fresh: list[bool]
    optimizer: torch.optim.Optimizer
    group: Any
    world_size: int
    comm_device: torch.device
    #: the engine's fp16 loss scaler (:func:`~.stepping.wrap_optimizer`);
    #: None: no loss scaling
    loss_scaler: Optional[LossScaler] = None
    #: DeepSpeed's: the last step was skipped for a non-finite gradient
    #: (the engine sets it; Accelerate's ``step_was_skipped`` reads it)
    overflow: bool = False
    #: the whole step of the engine that owns this optimizer (fp16 unscale
    #: and overflow skip, clipping), which :meth:`step` runs - DeepSpeed's ZeRO
    #: optimizers do all that in their own step(), and Lightning Fabric calls
    #: it directly; None (used on its own): :meth:`step` is :meth:`apply_step`
    engine_step: Optional[Callable[[], None]] = None
    #: the dtype the model's gradients are in (the engine's
    #: :func:`~.stepping.wrap_optimizer` sets it): :meth:`has_overflow`
    #: counts a sum that would not be finite in it (float16) as an overflow
    grad_dtype: Optional[torch.dtype] = None
    #: where this optimizer keeps what (offload flags; :mod:`~.offload`)
    placement: Placement
    stage: int
    #: the mpu's model-parallel group of more than one rank
    #: (:func:`~.stepping.wrap_optimizer` sets it; module docstring)
    model_parallel: Optional[ModelParallel] = None
    #: a backward gave gradients since the last step or zero_grad (each
    #: stage's ``reduce_gradients`` sets it): without one the inner step
    #: sees none (:meth:`_step_inner`)
    _arrived: bool = True
    #: the last step was skipped: the next clear zeroes the accumulators
    #: (:meth:`discard_round`)
    _discard: bool = False

    def step(self, closure: Any = None) -> None:
        """DeepSpeed's ``optimizer.step()``: the owning engine's whole step
        (:attr:`engine_step`: no engine counters or LR schedule move, as in
        DeepSpeed), else the inner step alone (:meth:`apply_step`)."""
        if closure is not None:
            raise DsrunError(f"{type(self).__name__}.step() takes no closure")
        if self.engine_step is not None:
            self.engine_step()
        else:
            self.apply_step()

    def apply_step(self) -> None:
        """The inner optimizer step on the masters, and the updated values
        into the parameters (each stage's optimizer has its own)."""
        raise NotImplementedError

    def reduce_gradients(self) -> None:  # pragma: no cover - every subclass defines it
        raise NotImplementedError

    def _get_scale(self) -> float:
        scaler = self.loss_scaler
        return 1.0 if scaler is None or isinstance(scaler, UnitLossScaler) else float(scaler.scale)

    def _set_scale(self, value: float, name: str) -> None:
        if self.loss_scaler is None or isinstance(self.loss_scaler, UnitLossScaler):
            raise DsrunError(f"optimizer.{name} = {value!r}: this model has no loss scaling "
                             "(only fp16 scales the loss; the scale here is always 1.0)")
        self.loss_scaler.scale = checked_scale(value, f"optimizer.{name}")

    #: DeepSpeed's ZeRO properties: the current loss scale (fp16: the dynamic
    #: or static scale; 1.0 without loss scaling). A write sets the scaler's
    #: scale, which the next backward and step use (as DeepSpeed's setter)
    cur_scale = property(_get_scale, lambda self, v: self._set_scale(v, "cur_scale"))
    loss_scale = property(_get_scale, lambda self, v: self._set_scale(v, "loss_scale"))

    @property
    def dynamic_loss_scale(self) -> bool:
        """DeepSpeed's ZeRO attribute: the loss scale is dynamic - an fp16
        model with ``fp16.loss_scale`` 0. False for a static scale, for bf16
        and fp32, and under ``torch_autocast`` (fp32 weights: its float16
        scaler is not this optimizer's in DeepSpeed either)."""
        scaler = self.loss_scaler
        return scaler is not None and scaler.dynamic and self.grad_dtype == torch.float16

    @dynamic_loss_scale.setter
    def dynamic_loss_scale(self, value: bool) -> None:
        # apex-era scripts set it after loading a checkpoint; the same value is
        # harmless, another would be a silent no-op (the config decides)
        if bool(value) != self.dynamic_loss_scale:
            raise DsrunError(f"optimizer.dynamic_loss_scale = {value!r}: the loss scaling "
                             f"mode is {'dynamic' if self.dynamic_loss_scale else 'not dynamic'}"
                             " here and is set by the config (fp16.loss_scale: 0 is dynamic)")

    # DeepSpeed's offload flags under its ZeRO optimizers' names: stages 1-2
    # have ``cpu_offload``, stage 3 ``offload_optimizer``/``offload_param``;
    # each is absent at the other stages, as there (hasattr tells them apart)
    def _deepspeed_flag(self, name: str, stage3: bool, value: bool) -> bool:
        if (self.stage == 3) != stage3:
            raise AttributeError(f"{type(self).__name__} (ZeRO stage {self.stage}) has no "
                                 f"{name!r}: DeepSpeed's stage {'3' if stage3 else '1-2'} "
                                 "optimizer attribute")
        return bool(value)

    @property
    def cpu_offload(self) -> bool:
        """DeepSpeed's stage 1-2 attribute: ``offload_optimizer`` is on."""
        return self._deepspeed_flag("cpu_offload", False, self.placement.offload_optimizer)

    @property
    def offload_optimizer(self) -> bool:
        """DeepSpeed's stage 3 attribute: ``offload_optimizer`` is on."""
        return self._deepspeed_flag("offload_optimizer", True, self.placement.offload_optimizer)

    @property
    def offload_param(self) -> bool:
        """DeepSpeed's stage 3 attribute: ``offload_param`` is on."""
        return self._deepspeed_flag("offload_param", True, self.placement.offload_param)

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @property
    def state(self) -> Any:
        return self.optimizer.state

    def _all_reduce(self, value: torch.Tensor, op: Any, what: str) -> None:
        if self.world_size > 1:
            reduce_on_device(value, op, self.group, self.comm_device)

    def _model_parallel_reduce(self, value: torch.Tensor, op: Any) -> None:
        """After the data-parallel reduction: over the model-parallel group
        (module docstring), where there is one."""
        if self.model_parallel is not None:
            reduce_on_device(value, op, self.model_parallel.group, self.comm_device)

    def _param_slices(self) -> list[tuple[Any, int, int, int]]:  # pragma: no cover
        """(parameter, master index, offset in that master, length) of each
        parameter's elements in this rank's masters (every subclass defines it)."""
        raise NotImplementedError

    def _inner_groups(self, hyper: list[dict[str, Any]], piece: Optional[int],
                      views: bool = False) -> list[dict[str, Any]]:
        """The inner optimizer's param groups: each master, in pieces of at
        most ``piece`` elements (None: whole; ``views``: pieces even then)."""
        self._pieces = [split_master(m, piece, views) for m in self.masters]
        return [{**h, "params": pieces} for h, pieces in zip(hyper, self._pieces)]

    def _build_inner(self, optimizer_cls: type, hyper: list[dict[str, Any]],
                     kwargs: Mapping[str, Any], sub_group_size: Optional[int],
                     offload: bool = False) -> torch.optim.Optimizer:
        """The inner optimizer over the masters (implementation and pieces
        as the module docstring says); ``offload``: masters in host memory
        whose updates go back to the GPU piece by piece (:meth:`_step_inner`)."""
        device = self.masters[0].device if self.masters else torch.device("cpu")
        chosen = inner_kwargs(optimizer_cls, kwargs, device)
        # dsrun.ops.adam's optimizers pick torch's fused kernel themselves
        fuses_itself = getattr(optimizer_cls, "fuses_where_torch_can", False) \
            and device.type in fused_devices()
        self.inner_impl = "fused" if chosen.get("fused") or fuses_itself else \
            "foreach" if chosen.get("foreach") else "single-tensor"
        picked = {k: chosen[k] for k in ("fused", "foreach") if k in chosen}
        for h in hyper:  # a client group that left both unset takes the choice too
            if h.get("fused") is None and h.get("foreach") is None:
                h.update(picked)
        sizing = {**chosen, "fused": True} if fuses_itself else chosen
        groups = self._inner_groups(hyper, piece_size(sub_group_size, sizing, device, offload),
                                    views=offload)
        return optimizer_cls(groups, **chosen)

    def _step_inner(self, publish: Optional[Callable[[int, int, int], None]] = None) -> None:
        """Bind each piece's gradient to its view of the master gradient, step.
        With ``publish(group, start, length)`` (offload) the pieces are
        stepped one at a time and each is published right after its step -
        its copy back to the GPU runs while the host steps the next piece
        (the inner optimizer skips pieces whose gradient is None).

        No backward since the last step (:attr:`_arrived` False): every
        master's gradient goes to None first, so the inner optimizer skips
        them all - torch's rule for parameters without ``.grad``, which stage
        0 follows (no move, no Adam step counted); a zero gradient would
        still move Adam's weights by momentum."""
        if not self._arrived:
            self._drop_master_grads()
        if publish is not None:
            self._step_published(publish)
            return
        for master, pieces in zip(self.masters, self._pieces):
            if len(pieces) == 1 and pieces[0] is master:
                continue
            offset = 0
            for piece in pieces:
                size = piece.numel()
                piece.grad = None if master.grad is None else \
                    master.grad.narrow(0, offset, size)
                offset += size
        self.optimizer.step()

    def _step_published(self, publish: Callable[[int, int, int], None]) -> None:
        for pieces in self._pieces:
            for piece in pieces:
                piece.grad = None
        for g, (master, pieces) in enumerate(zip(self.masters, self._pieces)):
            offset = 0
            for piece in pieces:
                size = piece.numel()
                if master.grad is not None and size:
                    piece.grad = master.grad.narrow(0, offset, size)
                    self.optimizer.step()
                    piece.grad = None
                publish(g, offset, size)
                offset += size

    def _drop_master_grads(self) -> None:
        """Every master's and piece's gradient to None (the next round
        allocates accumulators again)."""
        for master, pieces in zip(self.masters, self._pieces):
            master.grad = None
            for piece in pieces:
                piece.grad = None

    def _clear_master_grads(self, set_to_none: bool, zero: bool = True) -> None:
        """Release the masters' gradients, or keep them (zeroed when
        ``zero``: the next round adds into them; else the next round's
        first write to each element is a copy, :attr:`_fresh`)."""
        zero = zero or self._discard  # a skipped round's inf/NaN must not stay (discard_round)
        for master, pieces in zip(self.masters, self._pieces):
            if set_to_none or master.grad is None:
                master.grad = None
                for piece in pieces:  # their views would keep the storage alive
                    piece.grad = None
            elif zero:
                master.grad.zero_()
        self._fresh = [True] * len(self.masters)
        self._discard = False

    def _new_grad(self, master: torch.Tensor) -> torch.Tensor:
        """A zero gradient accumulator for ``master`` (pinned like it)."""
        return torch.zeros(master.shape, dtype=master.dtype, device=master.device,
                           pin_memory=master.is_pinned())

    def scale_grads_(self, factor: float) -> None:
        """Multiply the partition gradients by ``factor`` (fp16 unscaling)."""
        self.reduce_gradients()
        if factor != 1.0:
            for master in self.masters:
                master.grad.mul_(factor)  # type: ignore[union-attr]

    def has_overflow(self) -> bool:
        """True on every rank when any rank's partition gradient has an
        inf/NaN, or a value that would not be finite in :attr:`grad_dtype`
        (module docstring; call it before :meth:`scale_grads_`, on the
        scaled gradients, as DeepSpeed checks them): the flag is computed on
        the gradients' device, all-reduced, and read once (the step's one
        host synchronisation, as in DeepSpeed)."""
        self.reduce_gradients()
        flag = self.local_overflow().to(torch.float32).reshape(1)
        self._all_reduce(flag, dist.ReduceOp.MAX, "overflow check")
        self._model_parallel_reduce(flag, dist.ReduceOp.MAX)
        return bool(flag.item() > 0)

    def local_overflow(self) -> torch.Tensor:
        """This rank's part of :meth:`has_overflow`, reduced gradients
        assumed: a 0-d bool tensor on the gradients' device (no host sync)."""
        grads = [m.grad for m in self.masters if m.grad is not None and m.numel()]
        if not grads:
            return torch.zeros((), dtype=torch.bool, device=self.masters[0].device)
        return torch.logical_not(in_range(grads, overflow_limit(self.grad_dtype)))

    def grad_norm(self, norm_type: float = 2.0) -> torch.Tensor:
        """Global norm of the full mean gradient, from the partitions (the
        value ``clip_grad_norm_`` would compute on the full gradient, up to
        rounding: 2-norm as sqrt of all-reduced squared partition norms;
        padding is zero and adds nothing)."""
        self.reduce_gradients()
        grads = [m.grad for m in self.masters if m.numel()]
        device = self.masters[0].device
        if norm_type == math.inf:
            local = max((g.abs().max() for g in grads), default=torch.zeros((), device=device))
            total, op = local.to(torch.float32).reshape(1), dist.ReduceOp.MAX
        elif norm_type == 2.0:
            total, op = self._local_squares(grads, device), dist.ReduceOp.SUM
        else:
            raise ValueError(f"norm_type {norm_type} unsupported: use 2.0 or inf")
        self._all_reduce(total, op, "gradient norm")
        self._model_parallel_reduce(total, op)
        norm = total if norm_type == math.inf else total.sqrt()
        return norm.to(torch.float32).reshape(())

    def _local_squares(self, grads: list[torch.Tensor], device: torch.device) -> torch.Tensor:
        """This rank's share of the squared 2-norm (float64, one element):
        its whole partitions, or with model parallelism the pieces it counts
        (module docstring; :func:`~dsrun.runtime.norms.split_squares`)."""
        mp = self.model_parallel
        if mp is None:
            squares = [torch.linalg.vector_norm(g, dtype=torch.float32).double() ** 2
                       for g in grads]
            return torch.stack(squares).sum().reshape(1) if squares else \
                torch.zeros(1, dtype=torch.float64, device=device)
        counted: list[torch.Tensor] = []
        others: list[torch.Tensor] = []
        for param, g, offset, length in self._param_slices():
            grad = self.masters[g].grad
            if grad is not None and length:
                (counted if mp.counts(param) else others).append(grad.narrow(0, offset, length))
        return split_squares(counted, others, device)

    def clip_grad_norm(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Scale the partition gradients so that the global norm is at most
        ``max_norm`` (torch's rule: coefficient ``max_norm / (norm + 1e-6)``
        clamped to 1); returns the norm before clipping."""
        norm = self.grad_norm(norm_type)
        self.clip_to(norm, max_norm)
        return norm

    def clip_to(self, norm: torch.Tensor, max_norm: float) -> None:
        """Scale the partition gradients by torch's clipping coefficient for
        the global ``norm`` (:meth:`grad_norm`'s). A NaN norm leaves them
        as they are (as DeepSpeed's ZeRO clip, whose ``coefficient < 1``
        test is false for NaN): a NaN coefficient would turn the zero
        padding of the last partition NaN, which the next round's reduction
        never overwrites (it writes only real elements), so every later
        norm would be NaN. Decided on the device, without a host read."""
        if max_norm <= 0:
            return
        coefficient = torch.clamp(max_norm / (norm + CLIP_EPS), max=1.0)
        coefficient = torch.where(torch.isnan(coefficient),
                                  torch.ones_like(coefficient), coefficient)
        for master in self.masters:
            master.grad.mul_(coefficient)  # type: ignore[union-attr]

    def discard_round(self) -> None:
        """The step was skipped (a non-finite gradient): the next
        :meth:`_clear_master_grads` zeroes the accumulators whole, so no
        inf/NaN of this round - in the padding, which a reduction never
        writes, or anywhere else - reaches a later one."""
        self._discard = True

    def first_nonfinite(self, module: torch.nn.Module) -> Optional[str]:
        """The name in ``module`` of the first parameter whose elements in
        this rank's partitions hold an inf/NaN, or a sum :meth:`has_overflow`
        counts as one (reduced gradients, before ``zero_grad``); None when
        there is none. One host read per parameter: for the rate-limited
        skip warning only."""
        names = {id(p): n for n, p in module.named_parameters()}
        limit = overflow_limit(self.grad_dtype)
        for param, g, offset, length in self._param_slices():
            grad = self.masters[g].grad
            if grad is None or not length:
                continue
            if not bool(in_range([grad.narrow(0, offset, length)], limit)):
                return names.get(id(param), getattr(param, "ds_name", None)) or \
                    f"a parameter of shape {tuple(param.shape)}"
        return None
