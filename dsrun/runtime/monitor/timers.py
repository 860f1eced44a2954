"""Wall-clock breakdown: forward / backward / step timers per optimizer step,
and the registry that collective code reports its wait time into.

**Communication waits.** Code that blocks on a collective wraps the wait in
``with comm_wait("reduce"):`` (gradient reduction) or ``comm_wait("gather")``
(ZeRO parameter gathers); ZeRO's ``Pending.wait`` does it for every
collective it starts. While no engine asked for a breakdown, ``comm_wait``
returns a shared no-op context, so the hook costs one attribute read.
Nested waits count once (the outermost).

**Phases.** :class:`StepTimers` adds up, per optimizer step, the time spent
in the engine's forward, backward and step calls (every micro-step of an
accumulation), and the communication waits seen inside backward
(``backward_allreduce``; ``backward_inner`` is the rest) and in the whole
step (``comm_reduce``, ``comm_gather``). :meth:`StepTimers.take_means`
gives milliseconds per optimizer step averaged since the previous call.
Built with ``parts=PIPELINE_PARTS`` (a pipeline engine), it also times the
pipeline's own parts - every part not in the plain engine's set - through
the same ``phase``.

On a CUDA device the engine passes ``torch.cuda.synchronize`` as ``sync``:
each phase edge then waits for the device, so the times are device times
(and overlap between host and device is lost while the breakdown is on,
as with DeepSpeed's timers). A communication wait on CUDA synchronises at
its end, so it is an upper bound on the exposed communication time.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager as ContextManager
from typing import Any, Callable, Optional

from dsrun.runtime.monitor.events import BREAKDOWN_PARTS

COMM_KINDS = ("reduce", "gather")
PHASES = ("forward", "backward", "step")
Clock = Callable[[], float]
_NULL: ContextManager[None] = contextlib.nullcontext()


class CommWaits:
    """Seconds spent waiting per kind of collective, since the process started."""

    def __init__(self, clock: Clock = time.perf_counter) -> None:
        self.enabled = False
        self.totals = dict.fromkeys(COMM_KINDS, 0.0)
        self.sync: Optional[Callable[[], None]] = None
        self._clock = clock
        self._depth = 0

    def enable(self, sync: Optional[Callable[[], None]] = None) -> None:
        self.enabled = True
        if sync is not None:
            self.sync = sync

    def snapshot(self) -> dict[str, float]:
        return dict(self.totals)

    @contextlib.contextmanager
    def timed(self, kind: str) -> Iterator[None]:
        if kind not in self.totals:
            raise ValueError(f"unknown communication kind {kind!r}; known: {COMM_KINDS}")
        self._depth += 1
        start = self._clock() if self._depth == 1 else 0.0
        try:
            yield
        finally:
            self._depth -= 1
            if self._depth == 0:
                if self.sync is not None:
                    self.sync()
                self.totals[kind] += self._clock() - start


COMM_WAITS = CommWaits()


def comm_wait(kind: str) -> ContextManager[None]:
    """Time a blocking wait on a collective of ``kind`` ("reduce" or "gather")."""
    return COMM_WAITS.timed(kind) if COMM_WAITS.enabled else _NULL


class StepTimers:
    """Per-optimizer-step phase times, averaged over an interval (module doc)."""

    def __init__(self, enabled: bool, sync: Optional[Callable[[], None]] = None,
                 comm: CommWaits = COMM_WAITS, clock: Clock = time.perf_counter,
                 parts: tuple[str, ...] = BREAKDOWN_PARTS) -> None:
        missing = set(BREAKDOWN_PARTS) - set(parts)
        if missing:
            raise ValueError(f"StepTimers parts must include {sorted(missing)}")
        self.enabled = enabled
        self.parts = parts
        self._timeable = PHASES + tuple(p for p in parts if p not in BREAKDOWN_PARTS)
        self._sync = sync
        self._comm = comm
        self._clock = clock
        self._step = dict.fromkeys(parts, 0.0)  # seconds, this optimizer step
        self._last: dict[str, float] = {}  # milliseconds, the last step that ended
        self._sums = dict.fromkeys(parts, 0.0)  # seconds, this interval
        self._steps = 0
        self._comm_mark = comm.snapshot()
        if enabled:
            comm.enable(sync)

    def phase(self, name: str) -> ContextManager[None]:
        """Time one call of the engine's ``forward``/``backward``/``step``
        (or one of a pipeline's own parts)."""
        if not self.enabled:
            return _NULL
        if name not in self._timeable:
            raise ValueError(f"unknown phase {name!r}; known: {self._timeable}")
        return self._timed(name)

    @contextlib.contextmanager
    def _timed(self, name: str) -> Iterator[None]:
        if self._sync is not None:
            self._sync()
        comm_before = sum(self._comm.totals.values())
        start = self._clock()
        try:
            yield
        finally:
            if self._sync is not None:
                self._sync()
            self._step[name] += self._clock() - start
            if name == "backward":
                self._step["backward_allreduce"] += sum(self._comm.totals.values()) - comm_before

    def add(self, part: str, seconds: float) -> None:
        """Add to a part of the current step (e.g. ``monitor``, measured by its owner)."""
        if self.enabled:
            self._step[part] += seconds

    def end_step(self, iteration_s: float) -> None:
        """Close one optimizer step that took ``iteration_s`` of wall time."""
        if not self.enabled:
            return
        now = self._comm.snapshot()
        step = self._step
        step["comm_reduce"] = now["reduce"] - self._comm_mark["reduce"]
        step["comm_gather"] = now["gather"] - self._comm_mark["gather"]
        step["backward_inner"] = max(step["backward"] - step["backward_allreduce"], 0.0)
        step["iteration"] = iteration_s
        for part, seconds in step.items():
            self._sums[part] += seconds
        self._last = {part: 1000.0 * seconds for part, seconds in step.items()}
        self._steps += 1
        self._step = dict.fromkeys(self.parts, 0.0)
        self._comm_mark = now

    def take_means(self) -> dict[str, float]:
        """Milliseconds per optimizer step for every part, averaged over the
        steps since the last call (empty when none ended); resets."""
        if not self._steps:
            return {}
        means = {part: 1000.0 * total / self._steps for part, total in self._sums.items()}
        self._sums = dict.fromkeys(self.parts, 0.0)
        self._steps = 0
        return means

    def last_step_ms(self) -> dict[str, float]:
        """Milliseconds of every part in the last optimizer step that ended
        (empty before one has)."""
        return dict(self._last)

    @property
    def steps_pending(self) -> int:
        return self._steps


def format_breakdown(means: dict[str, float], steps: int) -> str:
    """The log line: ``time (ms per optimizer step, mean of N): forward ... | ...``."""
    parts = [f"forward {means['forward']:.2f}",
             f"backward {means['backward']:.2f} (communication wait "
             f"{means['backward_allreduce']:.2f})",
             f"step {means['step']:.2f} (monitor {means['monitor']:.2f})",
             f"reduce wait {means['comm_reduce']:.2f}",
             f"gather wait {means['comm_gather']:.2f}",
             f"iteration {means['iteration']:.2f}"]
    return f"time (ms per optimizer step, mean of {steps}): " + " | ".join(parts)


def cuda_sync(device: Any) -> Optional[Callable[[], None]]:
    """``torch.cuda.synchronize`` for a CUDA ``device``, else None."""
    if getattr(device, "type", None) != "cuda":
        return None
    import torch

    return lambda: torch.cuda.synchronize(device)
