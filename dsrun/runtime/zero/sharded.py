"""ZeRO stage 1 and 2: a sharded optimizer over flat fp32 partitions.

:class:`ZeroOptimizer` takes the client's parameter groups and optimizer
class and rebuilds the optimizer over this rank's partition
(:mod:`~.partition`): one flat fp32 **master** tensor per group (its
trainable parameters' elements that this rank owns), each alone in a param
group that carries the client group's hyperparameters. The inner optimizer
therefore keeps state only for 1/N of the parameters, and steps few large
tensors with torch's fused or foreach kernels (:mod:`~.masters`). Frozen
parameters (``requires_grad`` False) are kept whole in the model and never
touched.

**Flat buffers** (:mod:`~.flat`). A group's trainable parameters are views
of one flat buffer in the partition layout. When the parameters are fp32 on
the masters' device (fp32 and bf16-autocast training without offload), the
master *is* this rank's range of that buffer: the optimizer updates the
parameters in place - no fp32 copy, nothing to copy back, and the
all-gather after the step lands in place. Otherwise (fp16 parameters,
``offload_optimizer``) the master is a separate fp32 tensor and one cast
(or host -> device) copy per group writes it back.

Gradients (the mean over the data-parallel ``group``) reach the masters'
``.grad`` (fp32 partition accumulators; an fp16 sum beyond float16's range
is still an overflow, :mod:`~.masters`):

* **flat gradients** - stage 1 (reducing at the accumulation boundary) and
  stages 1-2 at world size 1 without offload: every ``param.grad`` is a view
  of one flat gradient buffer per group (:class:`~.flat.FlatGrads`), which
  backward accumulates into in place - no hook runs. At the boundary the
  buffer is pre-divided by N and reduced in place (all-reduce in chunks of
  ``reduce_bucket_size`` elements on gloo, a reduce-scatter on NCCL);
  this rank's range, when fp32 on the masters' device, *is* the master's
  gradient (else one cast/copy per group). At world size 1 there is
  nothing to reduce.
* **reduction during backward** - stage 2 (world size > 1 or offload) and
  stage 1 with ``reduce_in_backward=True`` (the engine's choice without
  gradient accumulation): :class:`~.reducer.GradReducer` hooks reduce
  gradients in buckets during every backward into the accumulators and
  release them at once; under offload the reduced ranges go to the host
  on a side stream while backward goes on (:class:`~.offload.Landing`).
  At stage 1 a parameter that gets several gradients in one backward (a
  reentrant activation checkpoint) is summed; stage 2 refuses it, as
  DeepSpeed's stage 2 does (:mod:`~.reducer`).

:meth:`step` runs the inner optimizer on the masters, then all-gathers the
updated partitions in place back into the parameters. Every rank must
start with the same parameter values (the engine broadcasts rank 0's first).

Interface for the engine (``zero = ZeroOptimizer(groups, torch.optim.AdamW,
defaults, stage=2, group=dp_group, settings=ZeroSettings.from_config(
config.zero_optimization))``), per optimizer step of ``gas`` micro-steps::

    for each micro-step:
        loss.backward()          # stage 2: buckets reduce during backward
        zero.micro_step_done()   # flushes the rest (no-op if done already)
    zero.reduce_gradients()      # stage 1: the reduction; idempotent
    if not zero.has_overflow():                 # fp16 only; all ranks agree
        zero.scale_grads_(1 / loss_scale)       # fp16 only
        norm = zero.clip_grad_norm(max_norm)    # == torch clip_grad_norm_ on
        zero.apply_step()                       #    the full mean gradient
    zero.zero_grad(set_to_none=False)           # keep the flat buffers

``zero.optimizer`` is the inner torch optimizer (LR schedulers step it;
``zero.param_groups`` is its param_groups); built by :meth:`from_optimizer`
it is the client's own optimizer object, its groups over the partitions. Gradients reduced in every
backward (:attr:`backward_hook_installed`) cannot defer synchronisation
(``no_sync``). World size 1 collapses to the plain update with no
communication, no hook and no copy (fp32/bf16): elementwise updates on a
flat tensor equal the per-parameter ones bitwise. The only host
synchronisations of a step are fp16's overflow agreement and, under
offload, the host waiting for the gradients it steps on.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch.optim import Optimizer

from dsrun import comm as collectives
from dsrun.errors import DsrunConfigError
from dsrun.runtime.zero.comm import all_gather_flat, reduce_scatter_mean, strategy_for
from dsrun.runtime.zero.flat import (
    FlatGrads,
    alias_or_copy,
    clear_flat_grads,
    flatten_into,
    trim_host_heap,
)
from dsrun.runtime.zero.groups import (  # noqa: F401 - re-exported for older imports
    UNSHARDABLE_OPTIMIZERS,
    ZeroSettings,
    _check_optimizer_cls,
    _check_params,
    _constructor_kwargs,
    _normalise_groups,
    check_not_stepped,
    comm_strategy,
    restore_partition_state,
    settings_values,
    take_over,
)
from dsrun.runtime.zero.masters import MasterGradients
from dsrun.runtime.zero.memory import StateBytes, count_bytes, tensors_in
from dsrun.runtime.zero.offload import HOST, HostFence, Landing, Placement, pinning
from dsrun.runtime.zero.partition import GroupLayout, partition_group, windows
from dsrun.runtime.zero.reducer import GradReducer, GradSource
from dsrun.runtime.zero.state_io import ShardedStateIO
from dsrun.runtime.zero.unsupported import RefusesAddParamGroup


class ZeroOptimizer(RefusesAddParamGroup, ShardedStateIO, MasterGradients):
    """ZeRO stage 1/2 optimizer (module docstring for the interface)."""

    def __init__(self, params: Iterable[Any], optimizer_cls: type[Optimizer],
                 defaults: Optional[Mapping[str, Any]] = None, *, stage: int,
                 group: Any = None, settings: Optional[ZeroSettings] = None,
                 backward_order: Optional[Sequence[torch.Tensor]] = None,
                 reduce_in_backward: Optional[bool] = None) -> None:
        if stage not in (1, 2):
            raise DsrunConfigError(f"ZeroOptimizer implements stages 1 and 2, got {stage}")
        _check_optimizer_cls(optimizer_cls, stage)
        self.stage = stage
        self.group = group
        self.settings = settings or ZeroSettings()
        self.strategy = self.settings.comm_strategy()
        self.world_size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        groups = _normalise_groups(params)
        sample = _check_params(groups)
        self.placement = Placement(sample.device if sample is not None else HOST,
                                   offload_optimizer=self.settings.offload_optimizer,
                                   pin_memory=self.settings.pin_memory)
        self.comm_device = self.placement.device
        self.param_groups_full = [list(g["params"]) for g in groups]
        self.layouts: list[GroupLayout] = [
            partition_group([p.numel() for p in ps], self.world_size, self.settings.alignment,
                            [p.requires_grad for p in ps]) for ps in self.param_groups_full]
        # Trainable parameters become views of one flat buffer per group, in
        # the partition layout: the master may alias it, gathers land in place.
        # An older engine's ZeRO optimizer over them is superseded (ownership.py)
        self.claim_params(p for ps in self.param_groups_full for p in ps if p.requires_grad)
        self._flats = [self._flatten_params(g) for g in range(len(self.layouts))]
        trim_host_heap()  # the parameter storages the flat buffers replaced (flat.py)
        made = [self._make_master(g) for g in range(len(self.layouts))]
        self.masters = [torch.nn.Parameter(m) for m, _ in made]
        self._aliased = [aliased for _, aliased in made]
        self._fresh = [True] * len(self.masters)
        hyper = [{k: v for k, v in g.items() if k != "params"} for g in groups]
        self.optimizer: Optimizer = self._build_inner(
            optimizer_cls, hyper, _constructor_kwargs(optimizer_cls, defaults or {}),
            self.settings.sub_group_size, offload=self.settings.offload_optimizer)
        self.comm_dtype = self.settings.comm_dtype or (sample.dtype if sample is not None else
                                                       torch.float32)
        self._landing = Landing()
        self._fence = HostFence()
        self._reduced = False
        self._reducer: Optional[GradReducer] = None
        self._grads: list[Optional[FlatGrads]] = [None] * len(self.layouts)
        # Stage 2 reduces during backward; stage 1 may too when every
        # micro-step is a boundary (no accumulation): the same traffic, but
        # overlapped with backward. At world size 1 without offload there is
        # nothing to reduce or move: backward writes the flat gradients.
        in_backward = stage == 2 if reduce_in_backward is None else reduce_in_backward
        if stage == 2 and not in_backward:
            raise DsrunConfigError("ZeRO stage 2 reduces gradients during backward")
        moves = self.world_size > 1 or self.settings.offload_optimizer
        if in_backward and moves and sample is not None:
            self._reducer = self._make_reducer(backward_order)
        else:
            self._grads = [self._flat_grads(g) for g in range(len(self.layouts))]

    @classmethod
    def from_optimizer(cls, optimizer: Optimizer, *, stage: int, group: Any = None,
                       settings: Optional[ZeroSettings] = None,
                       backward_order: Optional[Sequence[torch.Tensor]] = None,
                       reduce_in_backward: Optional[bool] = None) -> ZeroOptimizer:
        """Rebuild a client optimizer (not stepped yet) as a ZeRO one: same
        class, same per-group hyperparameters, and ``optimizer`` itself -
        its param-group dicts, now over the partitions - is the inner one
        that steps (:func:`~.groups.take_over`): the script's changes to it
        take effect, as in DeepSpeed."""
        check_not_stepped(optimizer, "partition")
        groups = [dict(g) for g in optimizer.param_groups]
        zero = cls(groups, type(optimizer), optimizer.defaults, stage=stage, group=group,
                   settings=settings, backward_order=backward_order,
                   reduce_in_backward=reduce_in_backward)
        zero.optimizer = take_over(optimizer, zero.optimizer)
        return zero

    # ------------------------------------------------------------ set-up

    def _members(self, g: int) -> list[torch.Tensor]:
        return [self.param_groups_full[g][i] for i in self.layouts[g].members]

    def _param_slices(self) -> list[tuple[Any, int, int, int]]:
        """Each piece of a parameter in this rank's partitions, as
        (parameter, master index, offset in the master, length)."""
        out = []
        for g, layout in enumerate(self.layouts):
            start, _ = layout.rank_range(self.rank)
            out += [(self.param_groups_full[g][piece.param], g, piece.flat_offset - start,
                     piece.length) for piece in layout.pieces(self.rank)]
        return out

    def _flatten_params(self, g: int) -> Optional[torch.Tensor]:
        layout = self.layouts[g]
        if not layout.members:
            return None
        offsets = [layout.offsets[i] for i in layout.members]
        return flatten_into(self._members(g), offsets, layout.padded_numel)  # type: ignore

    def _make_master(self, g: int) -> tuple[torch.Tensor, bool]:
        """This rank's fp32 master of group ``g``: an alias of its range of
        the flat buffer when possible (module docstring), else a copy."""
        layout = self.layouts[g]
        flat = self._flats[g]
        device = self.placement.master_device
        if flat is None:
            return torch.zeros(0, dtype=torch.float32, device=device), False
        start, _ = layout.rank_range(self.rank)
        pin = self.placement.pin_memory and self.placement.offload_optimizer
        if self.settings.offload_optimizer:  # separate, so its copies run (and are tested)
            master = torch.empty(layout.partition_numel, dtype=torch.float32, device=device,
                                 pin_memory=pinning(pin))
            master.copy_(flat.narrow(0, start, layout.partition_numel))
            return master, False
        return alias_or_copy(flat, start, layout.partition_numel, device, pin)

    def _flat_grads(self, g: int) -> Optional[FlatGrads]:
        layout = self.layouts[g]
        if not layout.members:
            return None
        return FlatGrads(self._members(g), [layout.offsets[i] for i in layout.members],
                         layout.padded_numel)  # type: ignore[misc]

    def _make_reducer(self, order: Optional[Sequence[torch.Tensor]]) -> GradReducer:
        return GradReducer(
            self._grad_sources(order), self.layouts, rank=self.rank,
            world_size=self.world_size, group=self.group,
            bucket_numel=self.settings.reduce_bucket_size,
            # under offload a slot is busy until its copy to the host is
            # done: two slots let backward go on meanwhile
            overlap=self.settings.overlap_comm or self.settings.offload_optimizer,
            contiguous=self.settings.contiguous_gradients, dtype=self.comm_dtype,
            land=self._land, strategy=self.strategy,
            before_reuse=self._landing.before_reuse, on_round_end=self._round_end,
            # stage 1 sums a parameter's gradients of one backward, as
            # DeepSpeed's does (stage 2 refuses them, as DeepSpeed's)
            add_extra=self._land_extra if self.stage == 1 else None)

    def _grad_sources(self, order: Optional[Sequence[torch.Tensor]]) -> list[GradSource]:
        sources = [GradSource(ps[i], g, i) for g, ps in enumerate(self.param_groups_full)
                   for i in self.layouts[g].members]
        if order is None:
            return sources[::-1]
        rank = {id(p): k for k, p in enumerate(order)}
        missing = [s for s in sources if id(s.param) not in rank]
        if missing:
            raise DsrunConfigError(f"backward_order lacks {len(missing)} trainable "
                                   "parameter(s) of the param groups")
        return sorted(sources, key=lambda s: rank[id(s.param)])

    def _accumulator(self, g: int) -> torch.Tensor:
        master = self.masters[g]
        if master.grad is None:
            master.grad = self._new_grad(master)
        return master.grad

    def _land(self, g: int, start: int, values: torch.Tensor) -> None:
        """A reduced range of group ``g``'s partition, from the reducer."""
        target = self._accumulator(g).narrow(0, start, values.numel())
        self._landing.put(target, values, add=not self._fresh[g])

    def _land_extra(self, g: int, start: int, values: torch.Tensor) -> None:
        """Reduced extra gradients of a round (reducer.py): added onto what
        the round landed."""
        target = self._accumulator(g).narrow(0, start, values.numel())
        self._landing.put(target, values, add=True)

    def _round_end(self) -> None:
        self._fresh = [False] * len(self.masters)

    # ------------------------------------------------------ torch-like API

    @property
    def backward_hook_installed(self) -> bool:
        """True when gradients are reduced by hooks during backward (stage 2,
        or stage 1 built with ``reduce_in_backward``, at world size > 1 or
        with offload)."""
        return self._reducer is not None

    def trainable_params(self) -> list[torch.Tensor]:
        return [p for g in range(len(self.layouts)) for p in self._members(g)]

    # ------------------------------------------------------------ gradients

    def micro_step_done(self) -> None:
        """After each backward: the reducer flushes what the end-of-backward
        callback has not (idempotent); flat gradients need nothing."""
        if self._reducer is not None:
            self._reducer.finish()

    def reduce_gradients(self) -> None:
        """At the accumulation boundary: make every master ``.grad`` hold
        this rank's partition of the group-mean gradient. Idempotent until
        :meth:`step` or :meth:`zero_grad`."""
        self.check_owner()  # a newer engine's buffers hold these parameters now
        if self._reduced:
            return
        if self._reducer is not None:
            self._reducer.finish()
            self._arrived = not all(self._fresh)  # a round ended: a backward gave gradients
        else:
            self._reduce_flat()
            self._arrived = any(grads.arrived for grads in self._grads if grads is not None)
        self._landing.wait()  # under offload: the host now holds every gradient
        for g in range(len(self.masters)):
            accumulator = self._accumulator(g)
            if self._reducer is not None and self._fresh[g]:
                # no backward since zero_grad: the kept buffer holds the last step's
                accumulator.zero_()
        self._fresh = [False] * len(self.masters)
        self._reduced = True

    def _reduce_flat(self) -> None:
        for g, grads in enumerate(self._grads):
            if grads is None:
                continue
            mine = self._reduce_group(grads.collect(), self.layouts[g].partition_numel)
            master = self.masters[g]
            if mine.dtype == master.dtype and mine.device == master.device \
                    and mine.shape == master.shape:
                master.grad = mine  # this rank's range of the flat gradient itself
            else:
                self._landing.put(self._accumulator(g), mine, add=False)

    def _reduce_group(self, flat: torch.Tensor, size: int) -> torch.Tensor:
        """This rank's ``size`` elements of the group mean of ``flat`` (the
        flat gradient, pre-divided here; may be a view of it)."""
        world = self.world_size
        if world == 1:
            return flat.narrow(0, 0, size)
        work = flat if flat.dtype == self.comm_dtype else flat.to(self.comm_dtype)
        work.mul_(1.0 / world)  # DDP's pre-division: bitwise its g * (1/N)
        strategy = self.strategy or strategy_for(self.group, work.device)
        if strategy.reduce != "all_reduce":
            return reduce_scatter_mean(work, self.group, strategy=strategy, premultiplied=True)
        chunk = self.settings.reduce_bucket_size
        works = [collectives.all_reduce(work.narrow(0, a, b - a), group=self.group, async_op=True)
                 for a, b in windows(work.numel(), chunk)]
        for handle in works:
            handle.wait()
        return work.narrow(0, self.rank * size, size)

    # ------------------------------------------------------------- update

    def apply_step(self) -> None:
        """Inner optimizer step on the partitions, then all-gather them into
        the model parameters. Reduces first if the engine has not."""
        self.reduce_gradients()
        self._fence.wait()  # the last host -> device copies read the masters
        offload = self.settings.offload_optimizer
        self._step_inner(self._publish if offload else None)
        self._gather_params(copy=not offload)  # offload: published piece by piece
        self._reduced = False

    @torch.no_grad()
    def _publish(self, g: int, start: int, length: int) -> None:
        """Copy ``length`` updated master elements from ``start`` into this
        rank's range of the flat buffer (cast, or host -> device)."""
        flat = self._flats[g]
        if flat is None or self._aliased[g] or not length:
            return
        master = self.masters[g].detach().narrow(0, start, length)
        offset = self.rank * self.layouts[g].partition_numel + start
        flat.narrow(0, offset, length).copy_(master, non_blocking=master.is_pinned())

    @torch.no_grad()
    def _gather_params(self, copy: bool = True) -> None:
        """Updated partitions into the flat buffers (with ``copy``: a cast or
        host -> device copy unless aliased), then the in-place all-gather."""
        for g, layout in enumerate(self.layouts):
            size = layout.partition_numel
            flat = self._flats[g]
            if size == 0 or flat is None:
                continue
            mine = flat.narrow(0, self.rank * size, size)
            if copy:
                self._publish(g, 0, size)
            if self.world_size > 1:
                all_gather_flat(mine, self.group, strategy=self.strategy, out=flat)
        if self.settings.offload_optimizer:
            self._fence.after_copies(self.placement.device)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop every gradient: model ``.grad``, a reduction round in
        progress, the partition accumulators. ``set_to_none=False`` (the
        engine's choice between steps) keeps the buffers instead: flat
        gradients stay bound and are zeroed (one fill per group), and the
        accumulators are kept unzeroed - the next reduction overwrites them
        whole before it adds anything."""
        if self._reducer is not None:
            self._reducer.reset()
        self._landing.wait()  # nothing may land in an accumulator after this
        clear_flat_grads(self._grads, set_to_none)
        if self._reducer is not None:
            for p in self.trainable_params():
                p.grad = None
        self._clear_master_grads(set_to_none, zero=False)
        self._reduced = False

    # ---------------------------------------------------------- reporting

    def state_bytes(self) -> StateBytes:
        """Bytes this rank holds now: the groups' parameters (frozen ones
        too) and gradients, the masters, their gradients and the inner
        optimizer's state; stage-2 bucket buffers as ``buffers``."""
        params = [p for ps in self.param_groups_full for p in ps]
        buffers = self._reducer.slot_buffers() if self._reducer is not None else []
        stepped = [p for g in self.optimizer.param_groups for p in g["params"]]
        grads = [t.grad for t in [*params, *self.masters, *stepped] if t.grad is not None]
        state = [t for s in self.optimizer.state.values() for t in tensors_in(s)]
        return count_bytes(params=params, grads=grads,
                           optimizer=[*self.masters, *stepped, *state], buffers=buffers)

    def state_dict(self) -> dict[str, Any]:
        """This rank's partition state (world-size dependent; checkpoints
        go through :mod:`dsrun.runtime.checkpoint`)."""
        return {"zero_stage": self.stage, "world_size": self.world_size, "rank": self.rank,
                "partition_numels": [lay.partition_numel for lay in self.layouts],
                "masters": [m.detach().clone() for m in self.masters],
                "optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` of the same rank and layout; the model
        parameters are refreshed from the restored masters."""
        restore_partition_state(state, "partition_numels",
                                [lay.partition_numel for lay in self.layouts],
                                self.world_size, self.rank, self.masters, self.optimizer)
        self._gather_params()

    def close(self) -> None:
        """Remove the stage-2 hooks (the parameters can be trained otherwise)."""
        if self._reducer is not None:
            self._reducer.close()
            self._reducer = None
