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
   after each step one all-gather refreshes them, as in DeepSpeed);
2. installs :class:`~.fetch.ParamFetcher` hooks: parameters are gathered
   before each module's forward and backward, released after, prefetched by
   trace;
3. reduces every gradient, as autograd produces it, into this rank's shard
   (:class:`~.reduce3.ShardGradReducer`: mean over ``group``, as DDP), and
   frees the full gradient;
4. re-creates the client optimizer over **fp32 masters**: per param group,
   one flat tensor of this rank's shards of the group's trainable
   parameters (:class:`~.stage3_plan.MasterLayout`), in a param group with
   the client group's hyperparameters. Frozen parameters are partitioned
   but have no master and are never updated;
5. :meth:`step` runs the inner optimizer and copies each master shard into
   ``param.ds_tensor`` (cast to the parameter dtype): the shard is the
   parameter's storage until the next forward gathers it.

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
    zero.scale_grads_(1 / loss_scale)          # fp16 only
    if not zero.has_overflow():                # fp16 only; all ranks agree
        norm = zero.clip_grad_norm(max_norm)   # == clip_grad_norm_ on the full mean grad
        zero.step()
    zero.zero_grad()

The engine must not broadcast or move parameters itself (build the module on
its device first; broadcast *buffers* only), and cannot defer gradient
synchronisation (``no_sync``): reduction happens in every backward. World
size 1 collapses to plain training: every parameter persists, ``ds_tensor``
is a view of the parameter, the update equals the plain one bitwise.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch.optim import Optimizer

from dsrun.errors import DsrunConfigError, DsrunError
from dsrun.runtime.zero.comm import CommStrategy
from dsrun.runtime.zero.divergence import DivergenceGuard, GuardSettings, shared_guard
from dsrun.runtime.zero.fetch import ParamFetcher
from dsrun.runtime.zero.init import GatheredParameters
from dsrun.runtime.zero.masters import MasterGradients, reduce_on_device
from dsrun.runtime.zero.memory import StateBytes, count_bytes, tensors_in
from dsrun.runtime.zero.offload import HOST, Placement, pinning, to_device
from dsrun.runtime.zero.partitioned import (
    ZeroParamStatus,
    broadcast_full,
    is_zero_param,
    move_param,
    offload_shard,
    partition_param,
    refresh_full,
    set_persistence,
)
from dsrun.runtime.zero.reduce3 import ShardGradReducer
from dsrun.runtime.zero.sharded import (
    DEFAULT_SUB_GROUP,
    _check_optimizer_cls,
    _constructor_kwargs,
    _normalise_groups,
    comm_strategy,
    restore_partition_state,
    settings_values,
)
from dsrun.runtime.zero.stage3_plan import MasterLayout, is_persistent
from dsrun.runtime.zero.state_io import Stage3StateIO


@dataclass(frozen=True)
class Stage3Settings:
    """The ``zero_optimization`` knobs stage 3 uses (sizes in elements).

    ``guard`` None reads ``DSRUN_ZERO_DEBUG``/``DSRUN_ZERO_TIMEOUT`` and
    shares the process-wide guard of the group (with ``zero.Init`` and
    ``GatheredParameters``); settings of its own give this optimizer its
    own guard. ``reduce_scatter`` False forces all-reduce for gradients.
    ``offload_optimizer`` keeps masters, their gradients and the optimizer
    state in host memory and steps there; ``offload_param`` keeps the
    shards there (:mod:`~.offload`); ``sub_group_size``: the inner
    optimizer steps at most this many elements per tensor (:mod:`~.masters`).
    """

    reduce_bucket_size: int = 500_000_000
    prefetch_bucket_size: int = 50_000_000
    max_live_parameters: int = 1_000_000_000
    param_persistence_threshold: int = 100_000
    overlap_comm: bool = True
    reduce_scatter: bool = True
    memory_efficient_linear: bool = True
    alignment: int = 1
    comm_dtype: Optional[torch.dtype] = None
    strategy: Optional[CommStrategy] = None
    guard: Optional[GuardSettings] = None
    offload_optimizer: bool = False
    offload_param: bool = False
    pin_memory: bool = False
    sub_group_size: int = DEFAULT_SUB_GROUP

    def __post_init__(self) -> None:
        for name, low in (("reduce_bucket_size", 1), ("prefetch_bucket_size", 0),
                          ("max_live_parameters", 0), ("param_persistence_threshold", 0),
                          ("alignment", 1), ("sub_group_size", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise DsrunConfigError(f"zero_optimization.{name} must be an integer >= {low}, "
                                       f"got {value!r}")

    @classmethod
    def from_config(cls, zero: Any, **overrides: Any) -> Stage3Settings:
        """From a ``ZeroConfig`` (or anything with its attribute names)."""
        names = ("reduce_bucket_size", "prefetch_bucket_size", "max_live_parameters",
                 "param_persistence_threshold", "overlap_comm", "reduce_scatter",
                 "memory_efficient_linear", "sub_group_size")
        return cls(**{**settings_values(zero, names, offload_param=True), **overrides})

    def comm_strategy(self) -> Optional[CommStrategy]:
        return comm_strategy(self.reduce_scatter, self.strategy)


class ZeroStage3(Stage3StateIO, MasterGradients):
    """ZeRO stage 3 over ``module`` (module docstring for the interface)."""

    stage = 3

    def __init__(self, module: torch.nn.Module, params: Optional[Iterable[Any]],
                 optimizer_cls: type[Optimizer], defaults: Optional[Mapping[str, Any]] = None,
                 *, group: Any = None, settings: Optional[Stage3Settings] = None,
                 device: Optional[torch.device] = None) -> None:
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
        if params is None:
            params = [p for p in module.parameters() if p.requires_grad]
        groups = _normalise_groups(params)
        self.param_groups_full = [list(g["params"]) for g in groups]
        self._check_membership()
        self._partition_module()
        if device is not None:
            for p in self.managed_params():
                move_param(p, torch.device(device))
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
        self.masters = [torch.nn.Parameter(self._initial_master(g))
                        for g in range(len(self.layouts))]
        hyper = [{k: v for k, v in g.items() if k != "params"} for g in groups]
        self.optimizer: Optimizer = optimizer_cls(
            self._inner_groups(hyper, self.settings.sub_group_size),
            **_constructor_kwargs(optimizer_cls, defaults or {}))
        self._reduced = False
        self._install_hooks()

    @classmethod
    def from_optimizer(cls, module: torch.nn.Module, optimizer: Optimizer, *, group: Any = None,
                       settings: Optional[Stage3Settings] = None,
                       device: Optional[torch.device] = None) -> ZeroStage3:
        """Rebuild a client optimizer (not stepped yet) over the shards: same
        class, same per-group hyperparameters."""
        if optimizer.state:
            raise DsrunConfigError("pass an optimizer that has not stepped yet: ZeRO rebuilds "
                                   "it over this rank's shards and would drop its state")
        return cls(module, [dict(g) for g in optimizer.param_groups], type(optimizer),
                   optimizer.defaults, group=group, settings=settings, device=device)

    # ------------------------------------------------------------ set-up

    def _check_membership(self) -> None:
        owned = {id(p) for p in self.module.parameters()}
        seen: set[int] = set()
        for g, params in enumerate(self.param_groups_full):
            for i, p in enumerate(params):
                where = f"param group {g}, parameter {i} (shape {tuple(p.shape)})"
                if id(p) in seen:
                    raise DsrunConfigError(f"{where} appears in more than one place")
                if id(p) not in owned:
                    raise DsrunConfigError(f"{where} is not a parameter of the module: ZeRO "
                                           "stage 3 partitions the module's parameters")
                seen.add(id(p))
        for name, p in self.module.named_parameters():
            if p.requires_grad and id(p) not in seen:
                raise DsrunConfigError(f"trainable parameter {name!r} is in no param group: "
                                       "freeze it (requires_grad_(False)) or add it")

    def _partition_module(self) -> None:
        """Partition what is not yet (rank 0's values), check what zero.Init
        partitioned, apply this optimizer's persistence threshold."""
        names = {id(p): n for n, p in self.module.named_parameters()}
        params = list(dict.fromkeys(self.module.parameters()))
        threshold = self.settings.param_persistence_threshold
        fresh = [p for p in params if not is_zero_param(p)]
        for p in params:
            if is_zero_param(p) and p.ds_spec.world_size != self.world_size:
                raise DsrunConfigError(
                    f"parameter {names[id(p)]!r} was partitioned over {p.ds_spec.world_size} "
                    f"ranks (zero.Init's group) but this optimizer's group has "
                    f"{self.world_size}: pass the same data_parallel_group to both")
        if fresh:
            self.guard.event("init", f"partition {type(self.module).__name__}", [],
                             [p.numel() for p in fresh])
            broadcast_full(fresh, self.group)
            for p in fresh:
                partition_param(p, group=self.group, alignment=self.settings.alignment,
                                persist=is_persistent(p.numel(), threshold, self.world_size))
        for persist in (True, False):
            change = [p for p in params if p.ds_persist != persist and
                      is_persistent(p.ds_numel, threshold, self.world_size) == persist]
            if change:
                self.guard.event("init", "persistence", [p.ds_id for p in change],
                                 [p.ds_numel for p in change])
                set_persistence(change, persist, self.strategy)
        for p in params:
            p.ds_name = names[id(p)]

    def _initial_master(self, g: int) -> torch.Tensor:
        """fp32 copy of this rank's shards of group ``g``'s trainable parameters."""
        params = self.param_groups_full[g]
        shards = [p.ds_tensor.detach() for p in params if p.requires_grad]
        device = self.placement.master_device
        pin = self.placement.pin_memory and self.placement.offload_optimizer
        if not shards:
            return torch.zeros(0, dtype=torch.float32, device=device)
        master = torch.empty(sum(t.numel() for t in shards), dtype=torch.float32,
                             device=device, pin_memory=pinning(pin))
        offset = 0
        for shard in shards:  # never a view of a shard: the master is separate
            master.narrow(0, offset, shard.numel()).copy_(shard)
            offset += shard.numel()
        return master

    def _install_hooks(self) -> None:
        trainable = self.trainable_params()
        sample = trainable[0].ds_tensor if trainable else None
        self.comm_dtype = self.settings.comm_dtype or (sample.dtype if sample is not None
                                                       else torch.float32)
        self.reducer = ShardGradReducer(
            group=self.group, world_size=self.world_size,
            bucket_numel=self.settings.reduce_bucket_size, overlap=self.settings.overlap_comm,
            dtype=self.comm_dtype, guard=self.guard, accumulator=self._accumulator,
            strategy=self.strategy)
        self.fetcher = ParamFetcher(
            self.module, guard=self.guard, strategy=self.strategy,
            prefetch_bucket=self.settings.prefetch_bucket_size,
            max_live=self.settings.max_live_parameters,
            memory_efficient_linear=self.settings.memory_efficient_linear)
        self.fetcher.on_backward_end(self.reducer.finish)
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad) for p in trainable]
        reload = weakref.WeakMethod(self._reload_master)
        for p in trainable:
            p._ds_on_modified = reload

    # ------------------------------------------------------ torch-like API

    @property
    def backward_hook_installed(self) -> bool:
        return True

    def trainable_params(self) -> list[torch.Tensor]:
        return [p for ps in self.param_groups_full for p in ps if p.requires_grad]

    def managed_params(self) -> list[torch.Tensor]:
        """Every parameter of the module (all partitioned), each once."""
        return list(dict.fromkeys(self.module.parameters()))

    # ------------------------------------------------------------ gradients

    def _on_grad(self, param: torch.Tensor) -> None:
        self.fetcher.begin_backward()
        self.reducer.add(param)
        self.fetcher.after_grad(param)

    def _accumulator(self, param: torch.Tensor) -> torch.Tensor:
        g, offset = self._slot[param.ds_id]
        master = self.masters[g]
        if master.grad is None:
            master.grad = self._new_grad(master)
        return master.grad.narrow(0, offset, param.ds_spec.shard_numel)

    def micro_step_done(self) -> None:
        """After each backward: flush the reduction, release what backward
        left gathered (idempotent)."""
        self.fetcher.finish_backward()
        self.reducer.finish()

    def reduce_gradients(self) -> None:
        """At the accumulation boundary: every master ``.grad`` holds this
        rank's shards of the mean gradient. Idempotent until step/zero_grad."""
        if self._reduced:
            return
        self.micro_step_done()
        for master in self.masters:
            if master.grad is None:
                master.grad = self._new_grad(master)
        self._reduced = True

    def _all_reduce(self, value: torch.Tensor, op: Any, what: str) -> None:
        """Announced to the divergence guard first, like every stage-3 collective."""
        if self.world_size > 1:
            self.guard.event("step", what)
            reduce_on_device(value, op, self.group, self.comm_device)

    # ------------------------------------------------------------- update

    def step(self, closure: Any = None) -> None:
        """Inner optimizer step on the masters; the shards become the
        parameters' storage; whole (persistent) parameters are refreshed."""
        if closure is not None:
            raise DsrunError("ZeroStage3.step() takes no closure")
        self.reduce_gradients()
        self._step_inner()
        self._write_back()
        self._reduced = False
        self.guard.step += 1

    @torch.no_grad()
    def _write_back(self) -> None:
        for g, (params, layout) in enumerate(zip(self.param_groups_full, self.layouts)):
            targets = [(p, offset) for p, offset in zip(params, layout.offsets)
                       if offset is not None]
            if not targets:
                continue
            # one host/device copy per group (offload), then local slices
            master = to_device(self.masters[g].detach(), targets[0][0].ds_tensor.device)
            for p, offset in targets:
                shard = master.narrow(0, offset, p.ds_spec.shard_numel)
                if p.ds_tensor.device != master.device:  # a world-size-1 alias stays put
                    shard = shard.to(p.ds_tensor.device)
                p.ds_tensor.copy_(shard)
        whole = [p for p in self.managed_params() if p.ds_status is ZeroParamStatus.AVAILABLE]
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
        if master is not None:
            master.copy_(param.ds_tensor)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop every gradient: model ``.grad``, a reduction in progress (and
        a backward that raised); the fp32 partition accumulators are
        released, or with ``set_to_none=False`` kept and zeroed (the engine's
        choice between steps: no re-allocation of Ψ/N elements each step)."""
        self.fetcher.abandon_backward()
        self.reducer.reset()
        for p in self.trainable_params():
            p.grad = None
        self._clear_master_grads(set_to_none)
        self._reduced = False

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
        with GatheredParameters(self.managed_params()):
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

    def close(self) -> None:
        """Remove every hook; parameters stay partitioned."""
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
        self.fetcher.close()
        self.reducer.reset()
        if self._own_guard:
            self.guard.close()
