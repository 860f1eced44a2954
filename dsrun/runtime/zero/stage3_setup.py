"""Setting up a ZeRO stage-3 optimizer's parameters: which ones it owns,
partitioning them with its settings, and its flat shard buffers.

* :func:`check_membership` - every parameter of the groups is one of the
  module's, in one place only (trainable parameters in no group are
  accepted and not trained, as in DeepSpeed);
* :func:`partition_for_optimizer` - partition what ``zero.Init`` did not
  (rank 0's values, broadcast), check what it did (same group size), and
  apply the optimizer's persistence threshold (``offload_param`` makes
  parameters host-resident: fetched on demand even at world size 1);
* :func:`flatten_shards` - a group's trainable shards as views of one flat
  buffer in master layout; at world size 1 without host residency the
  whole parameters too (their data and shards are the same elements);
* :class:`NoOptimizer` - the inner optimizer of a stage 3 built without
  one (partition only): no groups, no state, no step.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Optional

import torch

from dsrun.errors import DsrunConfigError, DsrunError
from dsrun.runtime.zero.comm import CommStrategy
from dsrun.runtime.zero.divergence import DivergenceGuard
from dsrun.runtime.zero.flat import flatten_into
from dsrun.runtime.zero.groups import Stage3Settings
from dsrun.runtime.zero.partitioned import (
    broadcast_full,
    is_zero_param,
    partition_param,
    set_persistence,
)
from dsrun.runtime.zero.stage3_plan import is_persistent

NO_OPTIMIZER = ("this ZeRO stage 3 engine has no optimizer (none in the config, none passed "
                "to initialize()): it partitions the parameters for forward only, as "
                "DeepSpeed's ZeRO-Offload engine; add an \"optimizer\" section or pass "
                "optimizer= to train it")


class NoOptimizer:
    """The inner optimizer of a partition-only stage 3: nothing to step."""

    def __init__(self) -> None:
        self.param_groups: list[dict[str, Any]] = []
        self.state: dict[Any, Any] = {}
        self.defaults: dict[str, Any] = {}

    def state_dict(self) -> dict[str, Any]:
        return {"state": {}, "param_groups": []}

    def load_state_dict(self, state: Any) -> None:
        """Nothing to restore."""

    def zero_grad(self, set_to_none: bool = True) -> None:
        """No gradients are kept."""

    def step(self, closure: Any = None) -> None:
        raise DsrunError(NO_OPTIMIZER)


def check_membership(module: torch.nn.Module, groups: Sequence[Sequence[torch.Tensor]]
                     ) -> None:
    """Raise unless every parameter of the groups is one of ``module``'s, in
    one place only. A trainable parameter in no group is accepted (DeepSpeed
    does): it is partitioned and never updated."""
    owned = {id(p) for p in module.parameters()}
    seen: set[int] = set()
    for g, params in enumerate(groups):
        for i, p in enumerate(params):
            where = f"param group {g}, parameter {i} (shape {tuple(p.shape)})"
            if id(p) in seen:
                raise DsrunConfigError(f"{where} appears in more than one place")
            if id(p) not in owned:
                raise DsrunConfigError(f"{where} is not a parameter of the module: ZeRO "
                                       "stage 3 partitions the module's parameters")
            seen.add(id(p))


def partition_for_optimizer(module: torch.nn.Module, *, group: Any, world_size: int,
                            settings: Stage3Settings, guard: DivergenceGuard,
                            strategy: Optional[CommStrategy]) -> None:
    """Partition what is not yet (rank 0's values), check what zero.Init
    partitioned, apply the persistence threshold (module docstring)."""
    names = {id(p): n for n, p in module.named_parameters()}
    params = list(dict.fromkeys(module.parameters()))
    threshold = settings.param_persistence_threshold
    host = settings.offload_param  # shards in host memory: fetched even at world 1
    for p in params:
        if is_zero_param(p) and p.ds_spec.world_size != world_size:
            raise DsrunConfigError(
                f"parameter {names[id(p)]!r} was partitioned over {p.ds_spec.world_size} "
                f"ranks (zero.Init's group) but this optimizer's group has "
                f"{world_size}: pass the same data_parallel_group to both")
    fresh = [p for p in params if not is_zero_param(p)]
    if fresh:
        guard.event("init", f"partition {type(module).__name__}", [],
                    [p.numel() for p in fresh])
        broadcast_full(fresh, group)
        for p in fresh:
            partition_param(p, group=group, alignment=settings.alignment,
                            persist=is_persistent(p.numel(), threshold, world_size, host))
    for persist in (True, False):
        change = [p for p in params if p.ds_persist != persist and
                  is_persistent(p.ds_numel, threshold, world_size, host) == persist]
        if change:
            guard.event("init", "persistence", [p.ds_id for p in change],
                        [p.ds_numel for p in change])
            set_persistence(change, persist, strategy)
    for p in params:
        p.ds_name = names[id(p)]


@torch.no_grad()
def flatten_shards(params: Sequence[torch.Tensor], offsets: Sequence[int], numel: int,
                   whole: bool) -> torch.Tensor:
    """``params``' shards as views of one zero-padded flat buffer of
    ``numel`` elements at ``offsets`` (pinned if the shards are); with
    ``whole`` (world size 1, persistent) the parameters' data too."""
    if whole:
        flat = flatten_into(params, offsets, numel)
    else:
        first = params[0].ds_tensor
        flat = torch.zeros(numel, dtype=first.dtype, device=first.device,
                           pin_memory=first.is_pinned())
        for p, offset in zip(params, offsets):
            flat.narrow(0, offset, p.ds_spec.shard_numel).copy_(p.ds_tensor)
    for p, offset in zip(params, offsets):
        p.ds_tensor = flat.narrow(0, offset, p.ds_spec.shard_numel)
    return flat
