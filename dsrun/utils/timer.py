"""DeepSpeed's ``deepspeed.utils.timer``: named wall-clock timers and the
throughput timer the engine drives (``engine.timers``, ``engine.tput_timer``).

* :class:`SynchronizedWallClockTimer` - ``timers(name).start()`` /
  ``.stop()`` / ``.elapsed(reset=True)`` (milliseconds, summed over every
  start-stop interval since the last reset; a running timer is counted up
  to now and keeps running), ``timers.log(names)`` (one ``time (ms) | name:
  t`` line printed on rank 0 whatever the logger's level, as DeepSpeed's),
  ``get_mean``. Host clocks; when CUDA is in use the device is synchronised
  at start and stop, so an interval covers the kernels launched inside it
  (DeepSpeed records CUDA events to the same end).
* :class:`ThroughputTimer` - samples per second over optimizer steps,
  leaving out the first ``start_step`` steps (warm-up), as DeepSpeed's:
  ``start()`` before a micro-step's work (the engine calls it in
  ``forward``), ``stop(global_step=...)`` after it (the engine calls it in
  ``step``, with ``global_step`` true at an accumulation boundary).
* :class:`NoopTimer` - the same interface doing nothing.

Invariant: nothing here communicates; "synchronized" means the device,
not the ranks (as in DeepSpeed).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from dsrun.runtime.commlog import trimmed_mean
from dsrun.runtime.progress import every
from dsrun.runtime.timer_names import *  # noqa: F403 - DeepSpeed's module exports them
from dsrun.utils.logging import print_dist

log = logging.getLogger("dsrun.runtime")

TIME_EPSILON = 1e-6

__all__ = ["NoopTimer", "SynchronizedWallClockTimer", "ThroughputTimer",
           "ThroughputTimerConfig", "trim_mean"]


def _synchronize() -> None:
    """Wait for the current CUDA device, where this process uses one."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def trim_mean(data: Iterable[float], trim_percent: float) -> float:
    """The mean of ``data`` without the lowest and highest ``trim_percent``
    fraction of values (0 for no data)."""
    if not 0.0 <= trim_percent <= 1.0:
        raise ValueError(f"trim_percent must be in [0, 1], got {trim_percent}")
    return trimmed_mean(data, trim_percent)


class SynchronizedWallClockTimer:
    """A group of named timers, made on first use (module docstring)."""

    class Timer:
        def __init__(self, name: str) -> None:
            self.name_ = name
            self.started_ = False
            self.start_time = 0.0
            self.end_time = 0.0
            self.event_timers: list[float] = []  # seconds per start-stop interval
            self.elapsed_records: Optional[list[float]] = None  # the same in ms

        def start(self) -> None:
            if self.started_:
                raise RuntimeError(f"timer {self.name_!r} has already been started")
            _synchronize()
            self.start_time = time.time()
            self.started_ = True

        def stop(self, reset: bool = False, record: bool = False) -> None:
            """End the interval (``reset``/``record`` are DeepSpeed's, unused there too)."""
            if not self.started_:
                raise RuntimeError(f"timer {self.name_!r} is not started")
            _synchronize()
            self.end_time = time.time()
            self.event_timers.append(self.end_time - self.start_time)
            self.started_ = False

        def reset(self) -> None:
            self.started_ = False
            self.elapsed_records = None
            self.event_timers.clear()

        def _elapsed_msec(self) -> float:
            self.elapsed_records = [seconds * 1000.0 for seconds in self.event_timers]
            return sum(self.elapsed_records)

        def elapsed(self, reset: bool = True) -> float:
            """Milliseconds timed since the last reset (a running interval
            counts up to now and goes on); then reset if asked."""
            running = self.started_
            if running:
                self.stop()
            total = self._elapsed_msec()
            if reset:
                self.reset()
            if running:
                self.start()
            return total

        def mean(self) -> float:
            """Trimmed (10%) mean of the intervals, in ms."""
            self.elapsed(reset=False)
            return trim_mean(self.elapsed_records or [], 0.1)

    def __init__(self) -> None:
        self.timers: dict[str, SynchronizedWallClockTimer.Timer] = {}

    def get_timers(self) -> dict[str, SynchronizedWallClockTimer.Timer]:
        return self.timers

    def __call__(self, name: str) -> SynchronizedWallClockTimer.Timer:
        if name not in self.timers:
            self.timers[name] = self.Timer(name)
        return self.timers[name]

    @staticmethod
    def memory_usage() -> str:
        """DeepSpeed's `` | mem_allocated: ... GB | ...`` suffix (zeros without CUDA)."""
        cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
        gib = 1024 ** 3
        values = [(name, fn() / gib if cuda else 0.0) for name, fn in (
            ("mem_allocated", torch.cuda.memory_allocated),
            ("max_mem_allocated", torch.cuda.max_memory_allocated),
            ("cache_allocated", torch.cuda.memory_reserved),
            ("max_cache_allocated", torch.cuda.max_memory_reserved))]
        return "".join(f" | {name}: {value:.4f} GB" for name, value in values)

    def log(self, names: Iterable[str], normalizer: float = 1.0, reset: bool = True,
            memory_breakdown: bool = False, ranks: Optional[Iterable[int]] = None) -> None:
        """One ``time (ms) | name: t | ...`` line (each timer's elapsed /
        ``normalizer``; names never started are left out) printed on
        ``ranks`` (default rank 0) with the rank prefix, whatever the
        logger's level: DeepSpeed prints it (``print_dist``) so that a script
        that quiets the logger keeps the timings it asked for."""
        if normalizer <= 0.0:
            raise ValueError(f"normalizer must be positive, got {normalizer}")
        line = "time (ms)"
        for name in names:
            if name in self.timers:
                line += f" | {name}: {self.timers[name].elapsed(reset=reset) / normalizer:.2f}"
        if memory_breakdown:
            line += self.memory_usage()
        print_dist(line, ranks=list(ranks or [0]))

    def get_mean(self, names: Iterable[str], normalizer: float = 1.0,
                 reset: bool = True) -> dict[str, float]:
        """DeepSpeed's values: each timer's trimmed mean (ms) x 1000 / ``normalizer``."""
        if normalizer <= 0.0:
            raise ValueError(f"normalizer must be positive, got {normalizer}")
        return {name: self.timers[name].mean() * 1000.0 / normalizer
                for name in names if name in self.timers}


class NoopTimer:
    """The timer interface, doing nothing (DeepSpeed's, for timing turned off)."""

    class Timer:
        def start(self) -> None:
            pass

        def reset(self) -> None:
            pass

        def stop(self, **kwargs: Any) -> None:
            pass

        def elapsed(self, **kwargs: Any) -> float:
            return 0

        def mean(self) -> float:
            return 0

    def __init__(self) -> None:
        self.timer = self.Timer()

    def __call__(self, name: str) -> NoopTimer.Timer:
        return self.timer

    def get_timers(self) -> dict[str, Any]:
        return {}

    def log(self, names: Iterable[str], normalizer: float = 1.0, reset: bool = True,
            memory_breakdown: bool = False, ranks: Optional[Iterable[int]] = None) -> None:
        pass

    def get_mean(self, names: Iterable[str], normalizer: float = 1.0,
                 reset: bool = True) -> None:
        pass


@dataclass(frozen=True)
class ThroughputTimerConfig:
    """A ``timers.throughput`` section for a timer built by a script
    (DeepSpeed's defaults; the engine's comes from its config:
    :class:`dsrun.runtime.config_sections.ThroughputConfig`)."""

    enabled: bool = True
    synchronized: bool = True


class ThroughputTimer:
    """Samples per second over optimizer steps (module docstring).

    Steps are counted by ``stop(global_step=True)``; intervals are added to
    ``total_elapsed_time`` (seconds) once ``global_step_count`` has reached
    ``start_step`` at their ``start()``. ``avg_samples_per_sec()`` is
    ``batch_size`` over the mean time of those steps; ``-inf`` before the
    first of them has ended (DeepSpeed's value before any step; it divides
    by zero in between)."""

    def __init__(self, config: Any = None, batch_size: Optional[int] = None,
                 start_step: int = 2, steps_per_output: Optional[int] = None,
                 monitor_memory: bool = False,
                 logging_fn: Optional[Callable[[str], Any]] = None) -> None:
        self.config = config if config is not None else ThroughputTimerConfig()
        self.start_time = 0.0
        self.end_time = 0.0
        self.started = False
        self.batch_size = 1 if batch_size is None else batch_size
        self.start_step = start_step
        self.epoch_count = 0
        self.micro_step_count = 0
        self.global_step_count = 0
        self.total_elapsed_time = 0.0
        self.step_elapsed_time = 0.0
        self.steps_per_output = steps_per_output
        self.monitor_memory = monitor_memory
        self.logging = logging_fn or log.info
        self.initialized = False
        if monitor_memory:
            import psutil  # noqa: F401 - DeepSpeed's requirement for monitor_memory

    def update_epoch_count(self) -> None:
        self.epoch_count += 1
        self.micro_step_count = 0

    def start(self) -> None:
        """Begin a micro-step's interval (again: restarts it)."""
        if not self.config.enabled:
            return
        self.initialized = True
        self.started = True
        if self.global_step_count >= self.start_step:
            if self.config.synchronized:
                _synchronize()
            self.start_time = time.time()

    def stop(self, global_step: bool = False, report_speed: bool = True) -> None:
        """End the interval; ``global_step``: it ended an optimizer step."""
        if not self.config.enabled or not self.started:
            return
        self.started = False
        self.micro_step_count += 1
        if global_step:
            self.global_step_count += 1
        if self.start_time <= 0:
            return  # still in the first start_step steps
        if self.config.synchronized:
            _synchronize()
        self.end_time = time.time()
        duration = self.end_time - self.start_time
        self.total_elapsed_time += duration
        self.step_elapsed_time += duration
        if global_step:
            if report_speed and self._is_report_boundary():
                self._report()
            self.step_elapsed_time = 0.0

    def _is_report_boundary(self) -> bool:
        return every(self.global_step_count, self.steps_per_output)

    def _report(self) -> None:
        cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
        allocated = round(torch.cuda.memory_allocated() / 1024 ** 3, 2) if cuda else 0.0
        peak = round(torch.cuda.max_memory_allocated() / 1024 ** 3, 2) if cuda else 0.0
        where = (f"epoch={self.epoch_count}/micro_step={self.micro_step_count}/"
                 f"global_step={self.global_step_count}")
        self.logging(f"{where}, RunningAvgSamplesPerSec={self.avg_samples_per_sec()}, "
                     f"CurrSamplesPerSec="
                     f"{self.batch_size / (self.step_elapsed_time + TIME_EPSILON)}, "
                     f"MemAllocated={allocated}GB, MaxMemAllocated={peak}GB")
        if self.monitor_memory:
            import psutil

            self.logging(f"{where}, vm %: {psutil.virtual_memory().percent}, "
                         f"swap %: {psutil.swap_memory().percent}")

    def avg_samples_per_sec(self) -> float:
        timed_steps = self.global_step_count - self.start_step
        if timed_steps <= 0 or self.total_elapsed_time <= 0:
            return float("-inf")
        return self.batch_size / (self.total_elapsed_time / timed_steps)
