"""ZeRO stage 1 and 2: a sharded optimizer over flat fp32 partitions.

:class:`ZeroOptimizer` takes the client's parameter groups and optimizer
class and rebuilds the optimizer over this rank's partition
(:mod:`~.partition`): one flat fp32 **master** tensor per group (its
trainable parameters' elements that this rank owns), each alone in a param
group that carries the client group's hyperparameters. The inner optimizer
therefore keeps state only for 1/N of the parameters. Frozen parameters
(``requires_grad`` False) are kept whole in the model and never touched.

Gradients (the mean over the data-parallel ``group``) reach the masters'
``.grad`` (fp32 partition accumulators):

* **stage 1**: backward accumulates full gradients in ``param.grad`` as
  usual (or, with ``reduce_in_backward=True`` - the engine's choice when
  there is no gradient accumulation - reduces them like stage 2, the same
  traffic overlapped with backward); :meth:`reduce_gradients` at the accumulation boundary reduce-
  scatters them (:func:`~.comm.reduce_scatter_mean`, in windows of
  ``reduce_bucket_size`` elements) and releases them.
* **stage 2**: :class:`~.reducer.GradReducer` hooks reduce them in buckets
  during every backward into the accumulators and release them at once.

:meth:`step` runs the inner optimizer on the masters, then all-gathers the
updated partitions (windows of ``allgather_bucket_size``) back into the
model parameters, cast to their dtype. Every rank must start with the same
parameter values (the engine broadcasts rank 0's first).

Interface for the engine (``zero = ZeroOptimizer(groups, torch.optim.AdamW,
defaults, stage=2, group=dp_group, settings=ZeroSettings.from_config(
config.zero_optimization))``), per optimizer step of ``gas`` micro-steps::

    for each micro-step:
        loss.backward()          # stage 2: buckets reduce during backward
        zero.micro_step_done()   # flushes the rest (no-op if done already)
    zero.reduce_gradients()      # stage 1: the reduce-scatter; idempotent
    zero.scale_grads_(1 / loss_scale)           # fp16 only
    if not zero.has_overflow():                 # fp16 only; all ranks agree
        norm = zero.clip_grad_norm(max_norm)    # == torch clip_grad_norm_ on
        zero.step()                             #    the full mean gradient
    zero.zero_grad()

``zero.optimizer`` is the inner torch optimizer (LR schedulers step it;
``zero.param_groups`` is its param_groups). Stage 2 reduces in every
backward, so it cannot defer synchronisation (``no_sync``); stage 1 can.
World size 1 collapses to the plain update: no communication, and the
elementwise update on a flat tensor equals the per-parameter one bitwise.

Optimizers whose update needs whole-tensor quantities (LAMB's trust ratio,
LARS, Adafactor's factored moments, LBFGS) would silently change meaning on
flat partitions: they are rejected (:data:`UNSHARDABLE_OPTIMIZERS`).
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch.optim import Optimizer

from dsrun.errors import DsrunConfigError, DsrunError
from dsrun.runtime.zero.comm import (
    CommStrategy,
    all_gather_flat,
    reduce_scatter_mean,
)
from dsrun.runtime.zero.masters import MasterGradients
from dsrun.runtime.zero.memory import StateBytes, model_state_bytes
from dsrun.runtime.zero.offload import HOST, Placement, offload_settings, pinning, to_device
from dsrun.runtime.zero.partition import GroupLayout, partition_group, windows
from dsrun.runtime.zero.reducer import GradReducer, GradSource
from dsrun.runtime.zero.state_io import ShardedStateIO

DEFAULT_SUB_GROUP = 1 << 20  # elements per optimizer-step piece (4 MiB of fp32)
UNSHARDABLE_OPTIMIZERS = ("Lamb", "FusedLamb", "LAMB", "Lars", "LARS", "FusedLars",
                          "Adafactor", "LBFGS", "SparseAdam", "Muon", "Shampoo")


@dataclass(frozen=True)
class ZeroSettings:
    """The ``zero_optimization`` knobs stages 1/2 use (sizes in elements).

    ``reduce_scatter`` False forces all-reduce for every gradient reduction
    (DeepSpeed's meaning); ``strategy`` overrides the per-backend choice of
    :mod:`~.comm`; ``comm_dtype`` None reduces in the parameters' dtype;
    ``alignment`` pads partitions to a multiple of it (elements);
    ``offload_optimizer`` keeps masters, their gradients and the optimizer
    state in host memory and steps there (:mod:`~.offload`), with
    ``pin_memory``; ``sub_group_size``: the inner optimizer steps at most
    this many elements per tensor (:mod:`~.masters`).
    """

    reduce_bucket_size: int = 500_000_000
    allgather_bucket_size: int = 500_000_000
    overlap_comm: bool = False
    contiguous_gradients: bool = True
    reduce_scatter: bool = True
    alignment: int = 1
    comm_dtype: Optional[torch.dtype] = None
    strategy: Optional[CommStrategy] = None
    offload_optimizer: bool = False
    pin_memory: bool = False
    sub_group_size: int = DEFAULT_SUB_GROUP

    def __post_init__(self) -> None:
        for name in ("reduce_bucket_size", "allgather_bucket_size", "alignment",
                     "sub_group_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise DsrunConfigError(f"zero_optimization.{name} must be a positive integer, "
                                       f"got {value!r}")

    @classmethod
    def from_config(cls, zero: Any, **overrides: Any) -> ZeroSettings:
        """From a ``ZeroConfig`` (or anything with the same attribute names)."""
        names = ("reduce_bucket_size", "allgather_bucket_size", "overlap_comm",
                 "contiguous_gradients", "reduce_scatter", "sub_group_size")
        return cls(**{**settings_values(zero, names, offload_param=False), **overrides})

    def comm_strategy(self) -> Optional[CommStrategy]:
        return comm_strategy(self.reduce_scatter, self.strategy)


def settings_values(zero: Any, names: Sequence[str], *, offload_param: bool) -> dict[str, Any]:
    """The ``names`` a ``ZeroConfig`` (or anything with its attribute names)
    sets, plus its offload sections (``offload_param`` too at stage 3)."""
    values = {n: getattr(zero, n) for n in names if getattr(zero, n, None) is not None}
    values.update(offload_settings(zero, param=offload_param))
    return values


def comm_strategy(reduce_scatter: bool, strategy: Optional[CommStrategy]
                  ) -> Optional[CommStrategy]:
    """``strategy`` (None: the backend's), or with ``reduce_scatter`` False
    an all-reduce for every gradient reduction (DeepSpeed's meaning)."""
    if reduce_scatter:
        return strategy
    gather = (strategy or CommStrategy()).gather
    return CommStrategy(reduce="all_reduce", owner_reduce="all_reduce", gather=gather)


def _normalise_groups(params: Iterable[Any]) -> list[dict[str, Any]]:
    """torch.optim's accepted forms -> list of dicts with a ``params`` list."""
    items = list(params)
    if not items:
        raise DsrunConfigError("ZeroOptimizer got an empty parameter list")
    if not isinstance(items[0], Mapping):
        items = [{"params": items}]
    groups = []
    for g, item in enumerate(items):
        if not isinstance(item, Mapping) or "params" not in item:
            raise DsrunConfigError(f"param group {g} must be a dict with 'params'")
        tensors = item["params"]
        tensors = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
        groups.append({**item, "params": tensors})
    return groups


def _check_params(groups: Sequence[Mapping[str, Any]]) -> Optional[torch.Tensor]:
    """Every tensor appears once; trainable ones share dtype and device and
    are contiguous, dense leaves. Returns one trainable tensor (or None)."""
    seen: set[int] = set()
    first: Optional[torch.Tensor] = None
    for g, group in enumerate(groups):
        for i, p in enumerate(group["params"]):
            where = f"param group {g}, parameter {i} (shape {tuple(p.shape)})"
            if id(p) in seen:
                raise DsrunConfigError(f"{where} appears in more than one place")
            seen.add(id(p))
            if not p.requires_grad:
                continue
            if p.is_sparse or not p.is_contiguous() or not p.is_leaf:
                raise DsrunConfigError(f"{where}: ZeRO needs dense, contiguous leaf tensors")
            first = p if first is None else first
            if (p.dtype, p.device) != (first.dtype, first.device):
                raise DsrunConfigError(f"{where} is {p.dtype} on {p.device}, the first "
                                       f"trainable one {first.dtype} on {first.device}: "
                                       "ZeRO stages 1/2 need one dtype and device")
    return first


def _check_optimizer_cls(optimizer_cls: type, stage: int) -> None:
    names = {k.__name__ for k in getattr(optimizer_cls, "__mro__", (optimizer_cls,))}
    bad = names.intersection(UNSHARDABLE_OPTIMIZERS)
    if bad:
        raise DsrunConfigError(
            f"optimizer {optimizer_cls.__name__} needs whole-tensor quantities (norms or "
            f"shapes) that a flat ZeRO partition does not have: it cannot run at ZeRO stage "
            f"{stage}; use stage 0, or an elementwise optimizer (Adam, AdamW, SGD, ...)")


def _constructor_kwargs(optimizer_cls: type, defaults: Mapping[str, Any]) -> dict[str, Any]:
    """``defaults`` that ``optimizer_cls(params, **kwargs)`` accepts."""
    try:
        signature = inspect.signature(optimizer_cls.__init__)
    except (TypeError, ValueError):
        return dict(defaults)
    accepted = signature.parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in accepted.values()):
        return dict(defaults)
    return {k: v for k, v in defaults.items() if k in accepted and k != "params"}


def restore_partition_state(state: Mapping[str, Any], numels_key: str, numels: list[int],
                            world_size: int, rank: int, masters: Sequence[torch.Tensor],
                            optimizer: Optimizer) -> None:
    """Load a per-rank state dict (masters + inner optimizer) saved by the
    same rank with the same partitioning; anything else is an error."""
    if (state["world_size"], state["rank"], list(state[numels_key])) != \
            (world_size, rank, numels):
        raise DsrunError(f"ZeRO stage {state.get('zero_stage', '?')} state of a different "
                         f"partitioning: world size {state['world_size']} rank "
                         f"{state['rank']} vs {world_size} rank {rank}")
    with torch.no_grad():
        for master, saved in zip(masters, state["masters"]):
            master.copy_(saved)
    optimizer.load_state_dict(state["optimizer"])


class ZeroOptimizer(ShardedStateIO, MasterGradients):
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
        self.masters = [torch.nn.Parameter(self._gather_own_elements(g))
                        for g in range(len(self.layouts))]
        # Trainable parameters become views of one flat buffer per group, in
        # the partition layout, so the post-step all-gather lands in place.
        self._flats = [self._flatten_params(g) for g in range(len(self.layouts))]
        hyper = [{k: v for k, v in g.items() if k != "params"} for g in groups]
        self.optimizer: Optimizer = optimizer_cls(
            self._inner_groups(hyper, self.settings.sub_group_size),
            **_constructor_kwargs(optimizer_cls, defaults or {}))
        dtype = self.settings.comm_dtype or (sample.dtype if sample is not None else
                                             torch.float32)
        self.comm_dtype = dtype
        self._reduced = False
        self._reducer: Optional[GradReducer] = None
        # Stage 2 always reduces during backward. Stage 1 may too when every
        # micro-step is a boundary (no accumulation): the same traffic, but
        # overlapped with backward instead of after it.
        in_backward = stage == 2 if reduce_in_backward is None else reduce_in_backward
        if stage == 2 and not in_backward:
            raise DsrunConfigError("ZeRO stage 2 reduces gradients during backward")
        if in_backward and sample is not None:
            self._reducer = GradReducer(
                self._grad_sources(backward_order), self.layouts, rank=self.rank,
                world_size=self.world_size, group=group,
                bucket_numel=self.settings.reduce_bucket_size,
                overlap=self.settings.overlap_comm,
                contiguous=self.settings.contiguous_gradients, dtype=dtype,
                accumulator=self._accumulator, strategy=self.strategy)

    @classmethod
    def from_optimizer(cls, optimizer: Optimizer, *, stage: int, group: Any = None,
                       settings: Optional[ZeroSettings] = None,
                       backward_order: Optional[Sequence[torch.Tensor]] = None,
                       reduce_in_backward: Optional[bool] = None) -> ZeroOptimizer:
        """Rebuild a client optimizer (not stepped yet) as a ZeRO one: same
        class, same per-group hyperparameters."""
        if optimizer.state:
            raise DsrunConfigError("pass an optimizer that has not stepped yet: ZeRO rebuilds "
                                   "it over this rank's partition and would drop its state")
        groups = [dict(g) for g in optimizer.param_groups]
        return cls(groups, type(optimizer), optimizer.defaults, stage=stage, group=group,
                   settings=settings, backward_order=backward_order,
                   reduce_in_backward=reduce_in_backward)

    # ------------------------------------------------------------ set-up

    def _gather_own_elements(self, g: int) -> torch.Tensor:
        """A fp32 copy of this rank's partition of group ``g`` (zero padding)."""
        layout = self.layouts[g]
        params = self.param_groups_full[g]
        start, _ = layout.rank_range(self.rank)
        shard = torch.zeros(layout.partition_numel, dtype=torch.float32,
                            device=self.placement.master_device,
                            pin_memory=pinning(self.placement.pin_memory and
                                               self.placement.offload_optimizer))
        with torch.no_grad():
            for piece in layout.pieces(self.rank):
                src = params[piece.param].detach().reshape(-1)
                shard.narrow(0, piece.flat_offset - start, piece.length).copy_(
                    src.narrow(0, piece.param_offset, piece.length))
        return shard

    @torch.no_grad()
    def _flatten_params(self, g: int) -> Optional[torch.Tensor]:
        layout = self.layouts[g]
        params = self.param_groups_full[g]
        if not layout.members:
            return None
        first = params[layout.members[0]]
        flat = torch.zeros(layout.padded_numel, dtype=first.dtype, device=first.device)
        for i in layout.members:
            param, offset = params[i], layout.offsets[i]
            assert offset is not None
            view = flat.narrow(0, offset, param.numel())
            view.copy_(param.detach().reshape(-1))
            param.data = view.view_as(param)
        return flat

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

    # ------------------------------------------------------ torch-like API

    @property
    def backward_hook_installed(self) -> bool:
        """True when gradients are reduced by hooks during backward (stage 2,
        or stage 1 built with ``reduce_in_backward``)."""
        return self._reducer is not None

    def trainable_params(self) -> list[torch.Tensor]:
        return [ps[i] for g, ps in enumerate(self.param_groups_full)
                for i in self.layouts[g].members]

    # ------------------------------------------------------------ gradients

    def micro_step_done(self) -> None:
        """After each backward: stage 2 flushes what the end-of-backward
        callback has not (idempotent); stage 1 does nothing."""
        if self._reducer is not None:
            self._reducer.finish()

    def reduce_gradients(self) -> None:
        """At the accumulation boundary: make every master ``.grad`` hold
        this rank's partition of the group-mean gradient. Idempotent until
        :meth:`step` or :meth:`zero_grad`."""
        if self._reduced:
            return
        if self._reducer is not None:
            self._reducer.finish()
        elif self.stage == 1:
            self._reduce_stage1()
        for g in range(len(self.masters)):
            self._accumulator(g)
        self._reduced = True

    def _reduce_stage1(self) -> None:
        world = self.world_size
        window = max(1, self.settings.reduce_bucket_size // world)
        for g, layout in enumerate(self.layouts):
            size = layout.partition_numel
            if size == 0:
                continue
            scratch = torch.empty(world * min(window, size), dtype=self.comm_dtype,
                                  device=self.placement.device)
            acc = self._accumulator(g)
            for a, b in windows(size, window):
                width = b - a
                flat = scratch.narrow(0, 0, world * width)
                for r in range(world):
                    self._read_grads(g, r * size + a, r * size + b,
                                     flat.narrow(0, r * width, width))
                shard = reduce_scatter_mean(flat, self.group, strategy=self.strategy)
                acc.narrow(0, a, width).add_(to_device(shard, acc.device))
        for p in self.trainable_params():
            p.grad = None

    def _read_grads(self, g: int, start: int, end: int, out: torch.Tensor) -> None:
        """Copy group ``g``'s flat gradient ``[start, end)`` into ``out``:
        zeros for padding and for parameters without a gradient."""
        layout = self.layouts[g]
        params = self.param_groups_full[g]
        covered = 0
        for piece in layout.pieces_in_range(start, end):
            grad = params[piece.param].grad
            view = out.narrow(0, piece.flat_offset - start, piece.length)
            if grad is None:
                view.zero_()
            else:
                view.copy_(grad.reshape(-1).narrow(0, piece.param_offset, piece.length))
            covered += piece.length
        if covered < end - start:  # only the tail padding is not covered
            out.narrow(0, covered, end - start - covered).zero_()

    # ------------------------------------------------------------- update

    def step(self, closure: Any = None) -> None:
        """Inner optimizer step on the partitions, then all-gather them into
        the model parameters. Reduces first if the engine has not."""
        if closure is not None:
            raise DsrunError("ZeroOptimizer.step() takes no closure")
        self.reduce_gradients()
        self._step_inner()
        self._gather_params()
        self._reduced = False

    @torch.no_grad()
    def _gather_params(self) -> None:
        world = self.world_size
        window = max(1, self.settings.allgather_bucket_size // world)
        for g, layout in enumerate(self.layouts):
            size = layout.partition_numel
            if size == 0:
                continue
            flat = self._flats[g]
            if flat is not None and window >= size:  # one window: in place
                mine = flat.narrow(0, self.rank * size, size)
                mine.copy_(self.masters[g].detach())
                all_gather_flat(mine, self.group, strategy=self.strategy, out=flat)
                continue
            params = self.param_groups_full[g]
            dtype = params[layout.members[0]].dtype
            device = self.placement.device
            scratch = torch.empty(world * min(window, size), dtype=dtype, device=device)
            for a, b in windows(size, window):
                width = b - a
                mine = to_device(self.masters[g].detach().narrow(0, a, width), device, dtype)
                full = all_gather_flat(mine, self.group, strategy=self.strategy,
                                       out=scratch.narrow(0, 0, world * width))
                for r in range(world):
                    start = r * size + a
                    for piece in layout.pieces_in_range(start, r * size + b):
                        target = params[piece.param].detach().view(-1)
                        target.narrow(0, piece.param_offset, piece.length).copy_(
                            full.narrow(0, r * width + piece.flat_offset - start,
                                        piece.length))

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop every gradient: model ``.grad``, a stage-2 round in progress;
        the fp32 partition accumulators are
        released, or with ``set_to_none=False`` kept and zeroed (the engine's
        choice between steps: no re-allocation of Ψ/N elements each step)."""
        if self._reducer is not None:
            self._reducer.reset()
        for p in self.trainable_params():
            p.grad = None
        self._clear_master_grads(set_to_none)
        self._reduced = False

    # ---------------------------------------------------------- reporting

    def state_bytes(self) -> StateBytes:
        """Bytes this rank holds now: the groups' parameters (frozen ones
        too) and gradients, the masters, their gradients and the inner
        optimizer's state; stage-2 bucket buffers as ``buffers``."""
        params = [p for ps in self.param_groups_full for p in ps]
        buffers = self._reducer.slot_buffers() if self._reducer is not None else []
        return model_state_bytes(params, self.optimizer, buffers)

    def state_dict(self) -> dict[str, Any]:
        """This rank's partition state (not world-size independent: the
        checkpoint issue consolidates)."""
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
