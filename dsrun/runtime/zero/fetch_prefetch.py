"""ZeRO stage 3 prefetching: which parameters :class:`~.fetch.ParamFetcher`
gathers ahead of their module, and which it keeps from forward to backward.

:class:`FetchPlanning` is the part of :class:`~.fetch.ParamFetcher` that
turns its traces into those decisions (the plans themselves are the pure
functions of :mod:`~.stage3_plan`); the fetcher holds the traces, the live
set, ``fetchable`` and the gathers (``_gather_batch``), and mixes this in.

**Prefetch.** The order in which modules ran in the previous forward
(backward) pass is the trace (:class:`~.stage3_plan.TraceCursor`). While the
current pass follows it, each module's pre-hook starts gathering the next
modules' parameters (:func:`~.stage3_plan.plan_prefetch`): at most
``prefetch_bucket`` elements fetched ahead and not used yet, and never more
than ``max_live`` elements gathered at once by prefetching (a module's own
gather always proceeds). A pass that leaves the trace stops prefetching until
the next pass, which follows the newly recorded order. Every gather, prefetch
or not, is one guard event, issued in the same order on all ranks as long as
they run the same modules.

**The turn from forward to backward.** Backward starts with the modules
forward ended with, and its first pre-hooks would gather them again right
after forward released them. So, following the previous backward's trace
within the same budget its prefetch would use (``prefetch_bucket``,
``max_live``), the modules at the end of a training forward keep those
parameters gathered (counted as fetched ahead); a parameter used early in
forward too (a tied embedding) is still released after its early use -
unless the forward trace uses it again later in the same pass: then it is
kept until that last use (one gather instead of two). The next forward's
start releases whatever backward did not use.

**Reuse distance.** ``stage3_max_reuse_distance`` (``max_reuse``, in
elements; 0, dsrun's default, turns it off) keeps more for backward, as in
DeepSpeed: a parameter whose first backward use comes within that many
elements of parameter uses after its last forward use is not released
there (:func:`~.stage3_plan.plan_reuse_keep`, within ``max_live``). A
distance larger than the model keeps every parameter from forward to
backward: no gather in backward, for the memory of the whole model's
parameters at the turn.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING

import torch

from dsrun.runtime.zero.partitioned import ZeroParamStatus
from dsrun.runtime.zero.stage3_plan import LiveSet, TraceCursor, plan_prefetch, plan_reuse_keep

if TYPE_CHECKING:
    from dsrun.runtime.zero.fetch import ParamFetcher


class _ModuleIds(Mapping):
    """module index -> ids of its fetchable parameters (for the planner)."""

    def __init__(self, fetcher: ParamFetcher) -> None:
        self.fetcher = fetcher

    def __getitem__(self, index: int) -> tuple[int, ...]:
        return tuple(p.ds_id for p in self.fetcher.fetchable(index))

    def __iter__(self) -> Iterator[int]:
        return iter(range(len(self.fetcher.modules)))

    def __len__(self) -> int:
        return len(self.fetcher.modules)


class _Resident:
    """Parameter ids whose full data is present or on its way."""

    def __init__(self, by_id: Mapping[int, torch.Tensor]) -> None:
        self.by_id = by_id

    def __contains__(self, pid: object) -> bool:
        param = self.by_id.get(pid)  # type: ignore[call-overload]
        return param is None or param.ds_status is not ZeroParamStatus.NOT_AVAILABLE


class FetchPlanning:
    """Prefetch and the turn to backward (module docstring); state set by ParamFetcher."""

    modules: list[torch.nn.Module]
    by_id: dict[int, torch.Tensor]
    _numels: dict[int, int]
    prefetch_bucket: int
    max_live: int
    max_reuse: int
    live: LiveSet
    forward_trace: TraceCursor
    backward_trace: TraceCursor
    _turn_keep: frozenset[int]  # ids kept from forward to backward
    _reuse_keep: frozenset[int]  # kept by the reuse distance
    _turn_from: int  # forward-trace position from which they are kept
    _last_use: dict[int, int]  # id -> last forward-trace position using it

    def _plan_turn(self) -> None:
        """At the start of a forward pass: which parameters the coming
        backward fetches first (the previous backward's trace, within the
        prefetch budget, as its own prefetch would), so that the end of this
        forward keeps them instead of releasing and gathering them again.
        Only the modules at the end of the forward trace keep theirs: a
        parameter used early (a tied embedding) is still released there."""
        self._turn_keep, self._turn_from = frozenset(), 0
        self._reuse_keep = frozenset()
        self._last_use = {}
        for position, module in enumerate(self.forward_trace.trace):
            for p in self.fetchable(module):
                self._last_use[p.ds_id] = position
        trace = self.backward_trace.trace
        if not trace or not self.forward_trace.trace:
            return
        if self.max_reuse > 0:
            self._reuse_keep = plan_reuse_keep(
                self.forward_trace.trace, trace, _ModuleIds(self), self._numels,
                max_distance=self.max_reuse, max_live=self.max_live)
        if self.prefetch_bucket <= 0:
            return
        plan = plan_prefetch(trace, -1, _ModuleIds(self), self._numels, (), ahead=0, live=0,
                             bucket=self.prefetch_bucket, max_live=self.max_live)
        self._turn_keep = frozenset(pid for _, ids in plan for pid in ids)
        self._turn_from = len(self.forward_trace.trace) - len(plan)

    def _keeps(self, param: torch.Tensor) -> bool:
        """Not released after this use: used again later in this forward
        (a tied weight), or kept at the turn to backward (:meth:`_plan_turn`:
        the prefetch budget, or the reuse distance after its last use)."""
        trace = self.forward_trace
        if not trace.on_track:
            return False
        if trace.position < self._last_use.get(param.ds_id, -1):
            return True
        if not torch.is_grad_enabled():
            return False
        return param.ds_id in self._reuse_keep or (
            param.ds_id in self._turn_keep and trace.position >= self._turn_from)

    def _prefetch(self, cursor: TraceCursor, phase: str) -> None:
        if self.prefetch_bucket <= 0:
            return
        plan = plan_prefetch(cursor.trace, cursor.position, _ModuleIds(self), self._numels,
                             _Resident(self.by_id), ahead=self.live.ahead, live=self.live.live,
                             bucket=self.prefetch_bucket, max_live=self.max_live)
        if plan:
            self._gather_batch([(module, tuple(self.by_id[i] for i in ids))
                                for module, ids in plan], phase, ahead=True)
