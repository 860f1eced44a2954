"""ZeRO stage 3: parameters, gradients and optimizer state all partitioned.

:class:`ZeroStage3` takes the client's module, parameter groups and
optimizer class, and:

1. **partitions** every parameter of the module (:mod:`~.partitioned`): a
   parameter built outside ``zero.Init`` gets group rank 0's values
   (broadcast), then each rank keeps its flat padded shard
   (:class:`~.stage3_plan.ShardSpec`, partition.py's maths for one tensor)
   in ``param.ds_tensor`` and ``param.data`` is emptied - except for
   parameters of at most ``param_persistence_threshold`` elements, which
   stay whole on every rank (their optimizer state is still partitioned:
   after each step one all-gather refreshes them, as in DeepSpeed; writes
   to their full data follow :mod:`~.whole_edits` - taken at initialize(),
   and into the shards before each step);
2. installs :class:`~.fetch.ParamFetcher` hooks: parameters are gathered
   before each module's forward and backward, released after, prefetched by
   trace; a leaf module (:mod:`dsrun.utils.z3_leaf_module`, flagged by the
   script or by ``leaf_module``: the config's section, None for DeepSpeed's
   default classes) is hooked as one unit, its whole subtree gathered;
3. reduces every gradient, as autograd produces it, into this rank's shard
   (:class:`~.reduce3.ShardGradReducer`: mean over ``group``, as DDP), and
   frees the full gradient; a leaf's gradients wait for the end of backward
   and are reduced together - zeros where this rank's pass used none of a
   parameter, so ranks that ran different experts reduce the same tensors;
4. re-creates the client optimizer over **fp32 masters**: per param group,
   the trainable parameters' shards are views of one flat buffer
   (:class:`~.stage3_plan.MasterLayout` order, :mod:`~.flat`) and the
   master is that buffer itself when it is fp32 where the optimizer steps
   (fp32/bf16 training; under ``offload_optimizer`` only with
   ``offload_param``, whose shards live in host memory too), else a
   separate fp32 copy; it sits in a param group with the client group's
   hyperparameters. Parameters in no param group (frozen ones, or
   trainable ones the client left out, as DeepSpeed allows) are
   partitioned but have no master and are never updated; the gradients
   of trainable ones are dropped as autograd produces them;
5. :meth:`step` runs the inner optimizer; an aliased master *is* the shards,
   otherwise one cast (or host -> device) copy per group writes the shards:
   the shard is the parameter's storage until the next forward gathers it.

Every collective is announced to a :class:`~.divergence.DivergenceGuard`
first, so ranks that run different modules get an error naming them.

Interface for the engine (same call order as
:class:`~.sharded.ZeroOptimizer`)::

    zero = ZeroStage3(module, param_groups, torch.optim.AdamW, defaults,
                      group=dp_group,
                      settings=Stage3Settings.from_config(config.zero_optimization))
    # or ZeroStage3.from_optimizer(module, client_optimizer, group=..., settings=...)
    for each micro-step:
        loss = module(batch)       # call the module itself: the hooks are on it
        loss.backward()            # gradients reduced into shards during backward
        zero.micro_step_done()     # flushes the last bucket (idempotent)
    zero.reduce_gradients()        # idempotent
    if not zero.has_overflow():                # fp16 only, on the still-scaled sums;
        zero.scale_grads_(1 / loss_scale)      # all ranks agree
        norm = zero.clip_grad_norm(max_norm)   # == clip_grad_norm_ on the full mean grad
        zero.apply_step()
    zero.zero_grad()

The engine must not broadcast or move parameters itself (build the module on
its device first; broadcast *buffers* only), and cannot defer gradient
synchronisation (``no_sync``): reduction happens in every backward.

**Without an optimizer** (``optimizer_cls`` None, no param groups:
:meth:`ZeroStage3.without_optimizer`, DeepSpeed's ``DeepSpeedZeRoOffload``
for reference and EMA models and evaluation) the parameters are
partitioned and gathered around each forward exactly as above, there is
no master and :meth:`apply_step` raises.

**World size 1** (without ``offload_param``) collapses to plain training
with nothing per parameter in the step: every parameter persists and is a
view of its group's flat buffer (``ds_tensor`` too), the gradients are
views of a flat gradient buffer that backward accumulates into
(:class:`~.flat.FlatGrads`; no hook is installed), the master is the flat
buffer and its gradient the flat gradient (fp32/bf16), and the update equals
the plain one bitwise for the same optimizer implementation. With
``offload_param`` the shards - the whole parameters - live in host memory
and each module's parameters come to the GPU for its forward and backward
only (:mod:`~.partitioned`), while their gradients go to the host as they
are produced (:class:`~.offload.Landing`).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Mapping
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch.optim import Optimizer

from dsrun.errors import DsrunError
from dsrun.runtime.zero import estimate as _estimate
from dsrun.runtime.zero.divergence import DivergenceGuard, shared_guard
from dsrun.runtime.zero.fetch import ParamFetcher
from dsrun.runtime.zero.flat import FlatGrads, alias_or_copy, trim_host_heap
from dsrun.runtime.zero.gathered import GatheredParameters
from dsrun.runtime.zero.groups import (
    Stage3Settings,
    _check_optimizer_cls,
    _constructor_kwargs,
    _normalise_groups,
    check_not_stepped,
    restore_partition_state,
    take_over,
)
from dsrun.runtime.zero.masters import MasterGradients
from dsrun.runtime.zero.memory import StateBytes, count_bytes, tensors_in
from dsrun.runtime.zero.offload import HOST, HostFence, Landing, Placement, pinning
from dsrun.runtime.zero.partitioned import (
    ZeroParamStatus,
    is_zero_param,
    move_param,
    offload_shard,
    refresh_full,
)
from dsrun.runtime.zero.reduce3 import ShardGradReducer
from dsrun.runtime.zero.stage3_grads import Stage3Gradients
from dsrun.runtime.zero.stage3_plan import MasterLayout
from dsrun.runtime.zero.stage3_setup import (
    NO_OPTIMIZER,
    NoOptimizer,
    check_membership,
    flatten_shards,
    partition_for_optimizer,
)
from dsrun.runtime.zero.state_io import Stage3StateIO
from dsrun.runtime.zero.unsupported import RefusesAddParamGroup
from dsrun.runtime.zero.weakhooks import remove_when_collected, weak_grad_hook
from dsrun.runtime.zero.whole_edits import EditTaker, LocalRebind, adopt_full, separate_whole
from dsrun.utils.z3_leaf_module import apply_zero_leaf_module_config


class ZeroStage3(RefusesAddParamGroup, Stage3Gradients, Stage3StateIO, MasterGradients):
    """ZeRO stage 3 over ``module`` (module docstring for the interface);
    the gradients' reduction into the masters is :mod:`~.stage3_grads`."""

    stage = 3
    _closed = False  # close() ran (it runs once)

    def __init__(self, module: torch.nn.Module, params: Optional[Iterable[Any]],
                 optimizer_cls: Optional[type[Optimizer]],
                 defaults: Optional[Mapping[str, Any]] = None,
                 *, group: Any = None, settings: Optional[Stage3Settings] = None,
                 device: Optional[torch.device] = None,
                 leaf_module: Optional[Mapping[str, Any]] = None) -> None:
        #: no optimizer: partition and gather only (module docstring)
        self.partition_only = optimizer_cls is None
        if optimizer_cls is not None:
            _check_optimizer_cls(optimizer_cls, 3)
        if not dist.is_initialized():
            raise DsrunError("ZeRO stage 3 needs torch.distributed: call "
                             "dsrun.init_distributed() first")
        self.module, self.group = module, group
        self.settings = settings or Stage3Settings()
        self.strategy = self.settings.comm_strategy()
        self.world_size, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self._own_guard = self.settings.guard is not None
        self.guard: DivergenceGuard = (DivergenceGuard(group, self.settings.guard)
                                       if self._own_guard else shared_guard(group))
        if params is None and not self.partition_only:
            params = [p for p in module.parameters() if p.requires_grad]
        groups = [] if self.partition_only else _normalise_groups(params or [])
        self.param_groups_full = [list(g["params"]) for g in groups]
        # before the fetcher decides what it hooks; None: DeepSpeed's default classes
        apply_zero_leaf_module_config(module, leaf_module or {})
        self._check_membership()
        # re-partitioned and hooked below: an older engine's ZeRO optimizer
        # over this module is superseded, its hooks off (ownership.py)
        self.claim_params(dict.fromkeys(module.parameters()))
        self._adopt_whole_values()
        self._partition_module()
        self._known_ids = {id(p) for p in self.module.parameters()}
        if device is not None:
            for p in self.managed_params():
                move_param(p, torch.device(device), keep_host_shard=self.settings.offload_param)
        params = self.managed_params()
        self.placement = Placement(
            torch.device(device) if device is not None else
            params[0].ds_device if params else HOST,
            offload_optimizer=self.settings.offload_optimizer,
            offload_param=self.settings.offload_param, pin_memory=self.settings.pin_memory)
        self.comm_device = self.placement.device
        if self.placement.offload_param:
            for p in params:
                offload_shard(p, self.placement.pin_memory)
        self.layouts = [MasterLayout(tuple(p.ds_spec.shard_numel for p in ps),
                                     tuple(p.requires_grad for p in ps))
                        for ps in self.param_groups_full]
        self._slot = {p.ds_id: (g, offset) for g, (ps, lay) in
                      enumerate(zip(self.param_groups_full, self.layouts))
                      for p, offset in zip(ps, lay.offsets) if offset is not None}
        # world size 1 without host residency: plain training, no hooks
        self._local = self.world_size == 1 and not self.settings.offload_param
        self._flats = [self._flatten_shards(g) for g in range(len(self.layouts))]
        trim_host_heap()  # the shards the flat buffers replaced (flat.py)
        made = [self._make_master(g) for g in range(len(self.layouts))]
        self.masters = [torch.nn.Parameter(m) for m, _ in made]
        self._aliased = [aliased for _, aliased in made]
        self._fresh = [True] * len(self.masters)
        self._written: set[int] = set()
        hyper = [{k: v for k, v in g.items() if k != "params"} for g in groups]
        self._publishing = not all(self._aliased) and self.settings.offload_optimizer
        # whole_edits: data edits taken where the shard is the value (frozen, aliased master)
        take = [p for p in self.managed_params()
                if p.ds_id not in self._slot or self._aliased[self._slot[p.ds_id][0]]]
        self._take_edits = LocalRebind(self.managed_params(), take) if self._local \
            else EditTaker(take)
        self.optimizer: Optimizer = NoOptimizer() if optimizer_cls is None else self._build_inner(
            optimizer_cls, hyper, _constructor_kwargs(optimizer_cls, defaults or {}),
            self.settings.sub_group_size, offload=self._publishing)
        if optimizer_cls is None:
            self._pieces, self.inner_impl = [], "none"
        self._landing = Landing()
        self._fence = HostFence()
        self._reduced = False
        self._grads: list[Optional[FlatGrads]] = [
            self._flat_grads(g) if self._local else None for g in range(len(self.layouts))]
        self._install_hooks()

    @classmethod
    def from_optimizer(cls, module: torch.nn.Module, optimizer: Optimizer, *, group: Any = None,
                       settings: Optional[Stage3Settings] = None,
                       device: Optional[torch.device] = None,
                       leaf_module: Optional[Mapping[str, Any]] = None) -> ZeroStage3:
        """Rebuild a client optimizer (not stepped yet) over the shards: same
        class, same per-group hyperparameters; ``optimizer`` itself, its
        param-group dicts now over the masters, is the inner one that steps
        (:func:`~.groups.take_over`), as in DeepSpeed."""
        check_not_stepped(optimizer, "shards")
        zero = cls(module, [dict(g) for g in optimizer.param_groups], type(optimizer),
                   optimizer.defaults, group=group, settings=settings, device=device,
                   leaf_module=leaf_module)
        zero.optimizer = take_over(optimizer, zero.optimizer)
        return zero

    @classmethod
    def without_optimizer(cls, module: torch.nn.Module, *, group: Any = None,
                          settings: Optional[Stage3Settings] = None,
                          device: Optional[torch.device] = None,
                          leaf_module: Optional[Mapping[str, Any]] = None) -> ZeroStage3:
        """Stage 3 without an optimizer (DeepSpeed's ``DeepSpeedZeRoOffload``):
        partitioned parameters gathered for forward, nothing to train."""
        return cls(module, None, None, group=group, settings=settings, device=device,
                   leaf_module=leaf_module)

    # ------------------------------------------------------------ set-up

    def _check_membership(self) -> None:
        check_membership(self.module, self.param_groups_full)

    def _adopt_whole_values(self) -> None:
        """Parameters zero.Init partitioned and kept whole: their full data,
        written or not since (a parent's ``reset_parameters``), is their
        value - group rank 0's, shards rebuilt (:mod:`~.whole_edits`)."""
        params = [p for p in dict.fromkeys(self.module.parameters()) if is_zero_param(p)
                  and p.ds_spec.world_size == self.world_size]  # others: refused next
        todo = separate_whole(params)
        if todo:
            self.guard.event("init", "whole parameters' values", [p.ds_id for p in todo],
                             [p.ds_numel for p in todo])
            adopt_full(todo, self.group)

    def _partition_module(self) -> None:
        partition_for_optimizer(self.module, group=self.group, world_size=self.world_size,
                                settings=self.settings, guard=self.guard,
                                strategy=self.strategy)

    def _trainable_in(self, g: int) -> tuple[list[torch.Tensor], list[int]]:
        """Group ``g``'s trainable parameters and their master offsets."""
        pairs = [(p, offset) for p, offset in zip(self.param_groups_full[g],
                                                   self.layouts[g].offsets)
                 if offset is not None]
        return [p for p, _ in pairs], [offset for _, offset in pairs]  # type: ignore[misc]

    def _flatten_shards(self, g: int) -> Optional[torch.Tensor]:
        params, offsets = self._trainable_in(g)
        return flatten_shards(params, offsets, self.layouts[g].numel, self._local) \
            if params else None

    def _make_master(self, g: int) -> tuple[torch.Tensor, bool]:
        """fp32 master of group ``g``'s shards: the flat shard buffer itself
        where dtype and device allow (module docstring), else a copy."""
        flat = self._flats[g]
        device = self.placement.master_device
        pin = self.placement.pin_memory and self.placement.offload_optimizer
        if flat is None:
            return torch.zeros(0, dtype=torch.float32, device=device), False
        if self.settings.offload_optimizer and not self.settings.offload_param:
            # separate even on CPU ranks, so that the offload copies run (and are tested)
            master = torch.empty(flat.numel(), dtype=torch.float32, device=device,
                                 pin_memory=pinning(pin))
            master.copy_(flat)
            return master, False
        return alias_or_copy(flat, 0, flat.numel(), device, pin)

    def _flat_grads(self, g: int) -> Optional[FlatGrads]:
        params, offsets = self._trainable_in(g)
        return FlatGrads(params, offsets, self.layouts[g].numel) if params else None

    def _install_hooks(self) -> None:
        trainable = self.trainable_params()
        sample = trainable[0].ds_tensor if trainable else None
        self.comm_dtype = self.settings.comm_dtype or (sample.dtype if sample is not None
                                                       else torch.float32)
        self.reducer = ShardGradReducer(
            group=self.group, world_size=self.world_size,
            bucket_numel=self.settings.reduce_bucket_size, overlap=self.settings.overlap_comm,
            dtype=self.comm_dtype, guard=self.guard, land=self._land,
            strategy=self.strategy, before_reuse=self._landing.before_reuse)
        self.fetcher = ParamFetcher(
            self.module, guard=self.guard, strategy=self.strategy,
            prefetch_bucket=self.settings.prefetch_bucket_size,
            max_live=self.settings.max_live_parameters,
            max_reuse=self.settings.max_reuse_distance,
            memory_efficient_linear=self.settings.memory_efficient_linear)
        self.fetcher.on_backward_end(self._finish_round)
        self._leaf_ids = frozenset(p.ds_id for p in self.fetcher.leaf_params())
        # (held weakly: the module must not keep a dropped engine alive)
        on_grad, drop = weak_grad_hook(self._on_grad), weak_grad_hook(self._drop_grad)
        self._hooks = [] if self._local else [
            p.register_post_accumulate_grad_hook(on_grad) for p in trainable]
        # trainable parameters in no param group: their gradients are not kept
        self._drop_hooks = [p.register_post_accumulate_grad_hook(drop)
                            for p in self.managed_params()
                            if p.requires_grad and p.ds_id not in self._slot]
        remove_when_collected(self, [*self._hooks, *self._drop_hooks])
        reload = weakref.WeakMethod(self._reload_master)
        for p in trainable:
            p._ds_on_modified = reload

    # ------------------------------------------------------ torch-like API

    @property
    def backward_hook_installed(self) -> bool:
        """False only at world size 1 without host residency (no hooks)."""
        return bool(self._hooks)

    def trainable_params(self) -> list[torch.Tensor]:
        return [p for ps in self.param_groups_full for p in ps if p.requires_grad]

    def _slotted(self) -> list[torch.Tensor]:
        """The parameters with a master slice (trainable at initialize())."""
        return [p for ps in self.param_groups_full for p in ps if p.ds_id in self._slot]

    def managed_params(self) -> list[torch.Tensor]:
        """Every parameter of the module (all partitioned), each once; one
        added to the module after initialize() is refused by name."""
        params = list(dict.fromkeys(self.module.parameters()))
        if any(id(p) not in self._known_ids for p in params):
            late = next(n for n, p in self.module.named_parameters()
                        if id(p) not in self._known_ids)
            raise DsrunError(
                f"parameter {late!r} was added to the model after dsrun.initialize(): ZeRO "
                "stage 3 partitions, hooks and steps the parameters it is given then; "
                "build every module before initialize()")
        return params

    # ------------------------------------------------------------- update

    def apply_step(self) -> None:
        """Inner optimizer step on the masters; the shards become the
        parameters' storage; whole (persistent) parameters are refreshed."""
        if self.partition_only:
            raise DsrunError(NO_OPTIMIZER)
        params = self.managed_params()  # refuses a module added since initialize()
        self.reduce_gradients()
        self._fence.wait()  # the last host -> device copies read the masters
        if not self._local:  # world size 1: taken before the gradients were collected
            self._take_edits()  # edits of whole parameters' data (whole_edits.py)
        self._step_inner(self._publish if self._publishing else None)
        self._write_back(copy=not self._publishing, params=params)  # else piece by piece
        self._reduced = False
        self.guard.step += 1

    @torch.no_grad()
    def _publish(self, g: int, start: int, length: int) -> None:
        """Copy ``length`` updated master elements from ``start`` into the
        group's flat shard buffer (cast, or host -> device)."""
        flat = self._flats[g]
        if flat is None or self._aliased[g] or not length:
            return
        master = self.masters[g].detach().narrow(0, start, length)
        flat.narrow(0, start, length).copy_(
            master, non_blocking=master.is_pinned() and flat.device.type == "cuda")

    @torch.no_grad()
    def _write_back(self, copy: bool = True,
                    params: Optional[list[torch.Tensor]] = None) -> None:
        """Masters into the shards (with ``copy``: one copy per group unless
        aliased), then the whole (persistent) parameters refreshed."""
        if copy:
            for g, flat in enumerate(self._flats):
                if flat is not None:
                    self._publish(g, 0, flat.numel())
        if not all(self._aliased):
            self._fence.after_copies(self.placement.device)
        if self._local:
            return  # every parameter is its shard, which the master just updated
        whole = [p for p in (self.managed_params() if params is None else params)
                 if p.ds_status is ZeroParamStatus.AVAILABLE]
        if whole and self.world_size > 1:
            self.guard.event("step", "refresh whole parameters", [p.ds_id for p in whole],
                             [p.ds_numel for p in whole])
        refresh_full(whole, self.strategy)

    def master_shard(self, param: torch.Tensor) -> Optional[torch.Tensor]:
        """The fp32 master view of ``param``'s shard on this rank (None for a
        frozen parameter), padding included."""
        slot = self._slot.get(getattr(param, "ds_id", None))
        if slot is None:
            return None
        return self.masters[slot[0]].detach().narrow(0, slot[1], param.ds_spec.shard_numel)

    def _reload_master(self, param: torch.Tensor) -> None:
        """``param.ds_tensor`` was changed from outside (GatheredParameters
        with a modifier rank): take it into the master."""
        master = self.master_shard(param)
        if master is not None and master.data_ptr() != param.ds_tensor.data_ptr():
            master.copy_(param.ds_tensor)

    # ---------------------------------------------------------- reporting

    def state_bytes(self) -> StateBytes:
        """Bytes this rank holds now: shards and any full data of the
        module's parameters, gradients (shard accumulators and any full
        ones), masters and optimizer state; staged reduction as buffers."""
        params = self.managed_params()
        grads = [t.grad for t in [*params, *self.masters] if t.grad is not None]
        state = [t for s in self.optimizer.state.values() for t in tensors_in(s)]
        return count_bytes(params=[t for p in params for t in (p.ds_tensor, p.data)],
                           grads=grads, optimizer=[*self.masters, *state],
                           buffers=self.reducer.buffers())

    def module_state_dict(self) -> dict[str, torch.Tensor]:
        """The module's full state dict on every rank (gathers everything;
        for saving whole weights)."""
        released = [p for p in self.managed_params()
                    if p.ds_status is not ZeroParamStatus.AVAILABLE]
        with GatheredParameters(released):  # whole ones are read as they are: no scratch
            return {k: v.detach().clone() for k, v in self.module.state_dict().items()}

    def state_dict(self) -> dict[str, Any]:
        """This rank's shard state (world-size dependent)."""
        return {"zero_stage": 3, "world_size": self.world_size, "rank": self.rank,
                "master_numels": [m.numel() for m in self.masters],
                "masters": [m.detach().clone() for m in self.masters],
                "optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` of the same rank and layout."""
        restore_partition_state(state, "master_numels", [m.numel() for m in self.masters],
                                self.world_size, self.rank, self.masters, self.optimizer)
        self._write_back()

    def empty_partition_cache(self) -> None:
        """Release the full parameters gathered now (outside a pass)."""
        self.fetcher.release_all()

    def close(self) -> None:
        """Remove every hook and give ``F.linear`` back (:mod:`~.linear`);
        parameters stay partitioned. ``engine.destroy()`` calls it; again is
        harmless: it must be, since after a newer engine took over this module
        (ownership.py) a second close would undo that engine's set-up."""
        if self._closed:
            return
        self._closed = True
        for handle in [*self._hooks, *self._drop_hooks]:
            handle.remove()
        self._hooks, self._drop_hooks = [], []
        self.fetcher.close()
        self.reducer.reset()
        if self._own_guard:
            self.guard.close()

    def destroy(self) -> None:
        """DeepSpeed's name for :meth:`close`."""
        self.close()


# DeepSpeed's names at this module path: the optimizer class for isinstance
# checks, and the stage-3 memory estimators (dsrun's numbers: .estimate)
DeepSpeedZeroOptimizer_Stage3 = ZeroStage3
estimate_zero3_model_states_mem_needs = _estimate.estimate_zero3_model_states_mem_needs
estimate_zero3_model_states_mem_needs_all_cold = \
    _estimate.estimate_zero3_model_states_mem_needs_all_cold
estimate_zero3_model_states_mem_needs_all_live = \
    _estimate.estimate_zero3_model_states_mem_needs_all_live
