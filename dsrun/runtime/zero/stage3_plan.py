"""ZeRO stage 3 bookkeeping: shards, persistence, master layout, prefetch
and live-parameter accounting (pure, no torch, no processes).

* :class:`ShardSpec` - one parameter's shard: the parameter alone is a
  :func:`~.partition.partition_group` of one tensor, so rank ``r`` holds
  flat elements ``[r * S, (r + 1) * S)`` of the parameter padded with zeros
  to ``N * S`` (``S`` = ``shard_numel``, a multiple of ``alignment``).
* :func:`is_persistent` - ``stage3_param_persistence_threshold``: a
  parameter with ``numel <= threshold`` (or any parameter at world size 1,
  unless its shard lives in host memory: ``offload_param``) is kept whole
  on every rank and never released.
* :class:`MasterLayout` - a param group's fp32 master: this rank's shard of
  every trainable parameter, back to back in group order.
* :class:`TraceCursor` - the module order of the previous pass (forward or
  backward), and whether the current pass still follows it.
* :func:`plan_prefetch` - which modules to fetch ahead, under
  ``stage3_prefetch_bucket_size`` and ``stage3_max_live_parameters``.
* :func:`plan_reuse_keep` - which parameters a training forward keeps
  gathered for backward under ``stage3_max_reuse_distance``.
* :class:`LiveSet` - elements of partitioned parameters gathered or in
  flight now, and how many of them were fetched ahead and not used yet.

Invariants (checked by tests/unit/test_zero_stage3_pure.py):

* the shards of all ranks cover the parameter exactly once, padding only at
  the end of the last non-empty shard(s);
* a prefetch plan never makes ``ahead`` exceed the bucket nor ``live``
  exceed ``max_live``: demand fetches (the module about to run) always go
  ahead, so ``live <= max(max_live, live before the prefetch)``;
* a plan names each parameter at most once and never a resident one;
* a parameter is kept for backward exactly when fewer than
  ``max_reuse_distance`` elements are used between its last forward use and
  its first backward use, nearest first while the kept total stays within
  ``max_live``.
"""

from __future__ import annotations

from collections.abc import Container, Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from typing import Optional

from dsrun.runtime.zero.partition import partition_group


def _check(name: str, value: int, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")


@dataclass(frozen=True)
class ShardSpec:
    """The shard layout of one parameter of ``numel`` elements (module docstring)."""

    numel: int
    world_size: int
    alignment: int = 1
    shard_numel: int = field(init=False)
    padded_numel: int = field(init=False)

    def __post_init__(self) -> None:
        layout = partition_group([self.numel], self.world_size, self.alignment)
        object.__setattr__(self, "shard_numel", layout.partition_numel)
        object.__setattr__(self, "padded_numel", layout.padded_numel)

    @property
    def full_rows(self) -> int:
        """Ranks whose shard holds only real elements."""
        return self.numel // self.shard_numel if self.shard_numel else 0

    @property
    def remainder(self) -> int:
        """Real elements in the one partly filled shard (0 if none)."""
        return self.numel - self.full_rows * self.shard_numel

    def valid(self, rank: int) -> int:
        """How many real (non-padding) elements rank ``rank``'s shard holds."""
        _check("rank", rank, 0)
        if rank >= self.world_size:
            raise ValueError(f"rank {rank} outside world size {self.world_size}")
        start = rank * self.shard_numel
        return max(0, min(self.numel - start, self.shard_numel))


def is_persistent(numel: int, threshold: int, world_size: int,
                  host_resident: bool = False) -> bool:
    """True when a parameter stays whole on every rank (module docstring);
    ``host_resident``: its shard lives in host memory (``offload_param``),
    so even at world size 1 it is brought to the device only when used."""
    _check("numel", numel, 0)
    _check("threshold", threshold, 0)
    return (world_size == 1 and not host_resident) or numel <= threshold


@dataclass(frozen=True)
class MasterLayout:
    """Where each trainable parameter's shard lies in its group's flat fp32
    master: ``offsets[i]`` (None for frozen parameters), ``numel`` in all."""

    shard_numels: tuple[int, ...]
    trainable: tuple[bool, ...]
    offsets: tuple[Optional[int], ...] = field(init=False)
    numel: int = field(init=False)

    def __post_init__(self) -> None:
        if len(self.shard_numels) != len(self.trainable):
            raise ValueError(f"{len(self.trainable)} trainable flags for "
                             f"{len(self.shard_numels)} parameters")
        offsets: list[Optional[int]] = []
        total = 0
        for i, (size, keep) in enumerate(zip(self.shard_numels, self.trainable)):
            _check(f"shard_numels[{i}]", size, 0)
            offsets.append(total if keep else None)
            total += size if keep else 0
        object.__setattr__(self, "offsets", tuple(offsets))
        object.__setattr__(self, "numel", total)


class TraceCursor:
    """Follows one kind of pass (forward or backward) over hooked modules.

    :meth:`start_pass` makes the order recorded during the previous pass the
    trace to follow; :meth:`visit` records a module and says whether the pass
    is still on the trace (only then is prefetching by the trace sound).
    Recording stops at ``max_len`` entries (a pass that never restarts).
    """

    def __init__(self, max_len: int) -> None:
        _check("max_len", max_len, 1)
        self.max_len = max_len
        self.trace: tuple[int, ...] = ()
        self._recorded: list[int] = []
        self._overflow = False
        self.position = -1
        self.on_track = False

    def start_pass(self) -> None:
        if self._recorded and not self._overflow:
            self.trace = tuple(self._recorded)
        elif self._overflow:
            self.trace = ()
        self._recorded, self._overflow = [], False
        self.position = -1
        self.on_track = bool(self.trace)

    def visit(self, module: int) -> bool:
        if len(self._recorded) < self.max_len:
            self._recorded.append(module)
        else:
            self._overflow = True
        self.position += 1
        self.on_track = (self.on_track and self.position < len(self.trace)
                         and self.trace[self.position] == module)
        return self.on_track


def plan_prefetch(trace: Sequence[int], position: int,
                  module_params: Mapping[int, Sequence[int]], numels: Mapping[int, int],
                  resident: Container[int], *, ahead: int, live: int, bucket: int,
                  max_live: int) -> tuple[tuple[int, tuple[int, ...]], ...]:
    """``(module, params)`` to fetch ahead, in trace order, after
    ``trace[position]``: each module's parameters that are neither
    ``resident`` (gathered or in flight) nor already planned. The walk stops
    at the first module that would push ``ahead`` (elements fetched ahead
    and not used yet) over ``bucket`` or ``live`` over ``max_live``; modules
    that need nothing are passed over. ``bucket`` 0 disables prefetching."""
    _check("bucket", bucket, 0)
    _check("max_live", max_live, 0)
    plan: list[tuple[int, tuple[int, ...]]] = []
    planned: set[int] = set()
    for module in trace[position + 1:]:
        need = tuple(p for p in dict.fromkeys(module_params.get(module, ()))
                     if p not in resident and p not in planned)
        if not need:
            continue
        size = sum(numels[p] for p in need)
        if ahead + size > bucket or live + size > max_live:
            break
        plan.append((module, need))
        planned.update(need)
        ahead += size
        live += size
    return tuple(plan)


def plan_reuse_keep(forward: Sequence[int], backward: Sequence[int],
                    module_params: Mapping[int, Sequence[int]], numels: Mapping[int, int], *,
                    max_distance: int, max_live: int) -> frozenset[int]:
    """Parameters that stay gathered from their last use in a training
    forward (the ``forward`` trace) to their first use in the following
    backward (the ``backward`` trace): those whose *reuse distance* - the
    elements of every parameter use in between, counted per use as
    DeepSpeed's ``stage3_max_reuse_distance`` does - is below
    ``max_distance``. Nearest first, the kept total stays within
    ``max_live``. Parameters not used in backward are never kept;
    ``max_distance`` 0 keeps nothing."""
    _check("max_distance", max_distance, 0)
    _check("max_live", max_live, 0)
    if max_distance == 0:
        return frozenset()
    sequence = [*forward, *backward]
    last_forward: dict[int, int] = {}
    for position, module in enumerate(forward):
        for p in module_params.get(module, ()):
            last_forward[p] = position
    first_backward: dict[int, int] = {}
    for position, module in enumerate(backward, start=len(forward)):
        for p in module_params.get(module, ()):
            first_backward.setdefault(p, position)
    # used[k]: elements used by the modules at sequence positions < k
    used = [0]
    for module in sequence:
        used.append(used[-1] + sum(numels[p] for p in dict.fromkeys(module_params.get(module, ()))))
    distances = sorted((used[first_backward[p]] - used[last + 1], p)
                       for p, last in last_forward.items() if p in first_backward)
    kept: set[int] = set()
    total = 0
    for distance, p in distances:
        if distance >= max_distance or total + numels[p] > max_live:
            break
        kept.add(p)
        total += numels[p]
    return frozenset(kept)


class LiveSet:
    """Partitioned parameters gathered or in flight now (by id), with their
    element counts, and which were fetched ahead and are not used yet."""

    def __init__(self) -> None:
        self._numel: dict[int, int] = {}
        self._ahead: set[int] = set()
        self.live = 0
        self.ahead = 0
        self.peak = 0

    def __contains__(self, param: int) -> bool:
        return param in self._numel

    def ids(self) -> AbstractSet[int]:
        return self._numel.keys()

    def add(self, param: int, numel: int, *, ahead: bool) -> None:
        if param in self._numel:
            raise ValueError(f"parameter {param} is already live")
        self._numel[param] = numel
        self.live += numel
        self.peak = max(self.peak, self.live)
        if ahead:
            self._ahead.add(param)
            self.ahead += numel

    def mark_ahead(self, param: int) -> None:
        """A live parameter is kept for a later use: it counts as ahead."""
        if param in self._numel and param not in self._ahead:
            self._ahead.add(param)
            self.ahead += self._numel[param]

    def use(self, param: int) -> None:
        """A module is about to use ``param``: it no longer counts as ahead."""
        if param in self._ahead:
            self._ahead.discard(param)
            self.ahead -= self._numel[param]

    def remove(self, param: int) -> None:
        numel = self._numel.pop(param, None)
        if numel is None:
            return
        self.live -= numel
        if param in self._ahead:
            self._ahead.discard(param)
            self.ahead -= numel
