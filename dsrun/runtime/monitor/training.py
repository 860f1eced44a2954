"""``engine.monitor``: what the engine reports per micro-step and per optimizer step.

The engine holds one :class:`EngineMonitor` and calls ``timed(phase)``
around forward and backward, ``comm_wait("reduce")`` around its own
gradient all-reduce wait (stage 0), ``saw_inputs`` in forward,
``record_loss`` in backward, and ``with optimizer_step(engine):`` around
the optimizer step. Scripts use DeepSpeed's ``enabled`` and
``write_events([(name, value, step)])``, and may set ``seq_length``.

Per optimizer step, rank 0 writes (step = ``global_samples``, as DeepSpeed):

* ``train_loss``: the mean over the step's micro-batches and over the
  data-parallel ranks - one all-reduce of ``[loss sum, count, tokens]`` on
  the data-parallel group, the only collective monitoring adds (none when
  no monitor section is enabled);
* ``lr`` per param group, ``loss_scale`` (fp16), ``grad_norm``: the
  step's own norm when clipping or fp16 computed it, else measured before
  the step (stage 0: from the all-reduced gradients; ZeRO: the optimizer's
  global norm over partitions, one more all-reduce);
* ``samples_per_sec`` = train_batch_size / the wall time between the ends
  of consecutive optimizer steps (the first from the first forward), and
  ``tokens_per_sec`` when tokens per sample are known: ``seq_length``
  (``{"dsrun": {"seq_length": N}}`` or ``engine.monitor.seq_length = N``)
  gives ``train_batch_size * N`` tokens per step; otherwise the engine
  counts ``numel()`` of forward's first argument (or ``input_ids=``) when
  it is a 2-D integer (batch, seq) tensor, summed over the micro-batches
  run with gradients enabled (not evaluation under ``torch.no_grad()``)
  and over ranks; otherwise tokens/s is not written.

With ``wall_clock_breakdown``, every ``steps_per_print`` steps rank 0 logs
the breakdown averaged over the interval and, when monitors are enabled,
writes it as ``Train/Samples/elapsed_time_ms_<part>`` events. The ``step``
part is the whole optimizer-step call, including the monitor's own work
(the loss all-reduce - where a rank also waits for the slowest one - and
the writes), which is reported again on its own as ``monitor``.

A pipeline engine uses a subclass (:mod:`dsrun.runtime.pipe.metrics`) that
times its own parts (``PARTS``), measures the gradient norm over all stages
inside the step instead of before it (``grad_norm_before_step``) and logs
one breakdown line per stage (``breakdown_line``).
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager as ContextManager
from typing import Any, Optional

import torch
import torch.distributed as dist

from dsrun import comm as collectives
from dsrun.monitor.config import DeepSpeedMonitorConfig
from dsrun.monitor.monitor import MonitorMaster
from dsrun.runtime.config_monitors import MONITOR_SECTIONS
from dsrun.runtime.monitor import events as ev
from dsrun.runtime.monitor.timers import StepTimers, comm_wait, cuda_sync, format_breakdown
from dsrun.runtime.monitor.writers import build_writers
from dsrun.runtime.progress import every

log = logging.getLogger("dsrun.runtime.monitor")


def count_tokens(args: Sequence[Any], kwargs: dict[str, Any]) -> int:
    """Tokens in a micro-batch: numel of a (batch, seq) integer first input, else 0."""
    first = args[0] if args else kwargs.get("input_ids")
    if (isinstance(first, torch.Tensor) and first.dim() == 2
            and not first.is_floating_point() and not first.is_complex()
            and first.dtype != torch.bool):
        return first.numel()
    return 0


def measure_grad_norm(engine: Any) -> Optional[float]:
    """The global gradient norm before the step, where the step will not
    compute it: stage 0 without clipping in a precision that does not always
    measure it (ZeRO steps always do)."""
    if engine.config.gradient_clipping > 0 or engine.zero_stage > 0 or \
            engine.precision.reports_norm:
        return None
    grads = [p.grad for p in engine.precision.params if p.grad is not None]
    if not grads:
        return None
    norms = torch.stack([torch.linalg.vector_norm(g, dtype=torch.float32) for g in grads])
    return float(torch.linalg.vector_norm(norms))


class EngineMonitor(MonitorMaster):
    """The engine's metrics (module docstring): DeepSpeed's ``MonitorMaster``
    (``isinstance(engine.monitor, deepspeed.monitor.monitor.MonitorMaster)``,
    as in DeepSpeed), whose writers come from the engine's config - its
    source named in errors, every directory checked before any writer
    starts, the run's description beside the CSV files for ``dsrun plot``
    (:func:`~dsrun.runtime.monitor.writers.build_writers`)."""

    PARTS: tuple[str, ...] = ev.BREAKDOWN_PARTS  # what the breakdown times and writes

    def __init__(self, config: Any, *, rank: int, group: Any, device: torch.device) -> None:
        # monitor_config is DeepSpeed's: the four monitor sections (and .enabled)
        sections = DeepSpeedMonitorConfig(
            **{name: getattr(config, name) for name in MONITOR_SECTIONS}, source=config.source)
        self._start(sections, rank, lambda _: build_writers(config))  # enabled, rank, writers
        self.seq_length: Optional[int] = config.dsrun.seq_length
        self._group = group
        self._device = device
        self._batch = config.train_batch_size
        self._print_every = config.steps_per_print
        self.timers = StepTimers(config.wall_clock_breakdown, sync=cuda_sync(device),
                                 parts=self.PARTS)
        self._loss_sum: Optional[torch.Tensor] = None
        self._loss_count = 0
        self._tokens = 0
        self._grad_norm: Optional[float] = None
        self._last_end: Optional[float] = None

    # ------------------------------------------------- DeepSpeed's interface

    def set_batch(self, config: Any) -> None:
        """The engine's batch size changed (``set_train_batch_size``)."""
        self._batch = config.train_batch_size

    # DeepSpeed's MonitorMaster attributes: the backend's writer on rank 0,
    # None where it is disabled, on other ranks, or after it failed
    # (``tb_monitor.summary_writer`` is the SummaryWriter, for histograms).
    @property
    def tb_monitor(self) -> Any:
        return self._writer("tensorboard")

    @property
    def csv_monitor(self) -> Any:
        return self._writer("csv_monitor")

    @property
    def wandb_monitor(self) -> Any:
        return self._writer("wandb")

    @property
    def comet_monitor(self) -> Any:
        return self._writer("comet")

    def _writer(self, name: str) -> Any:
        return next((w for w in self.writers if w.name == name), None)

    # ----------------------------------------------------------- engine hooks

    def timed(self, phase: str) -> ContextManager[None]:
        return self.timers.phase(phase)

    @staticmethod
    def comm_wait(kind: str) -> ContextManager[None]:
        return comm_wait(kind)

    def saw_inputs(self, args: Sequence[Any], kwargs: dict[str, Any]) -> None:
        if self._last_end is None:
            self._last_end = time.perf_counter()
        if self.enabled and self.seq_length is None and torch.is_grad_enabled():
            self._tokens += count_tokens(args, kwargs)  # not evaluation forwards

    def record_loss(self, loss: torch.Tensor) -> None:
        if self._last_end is None:
            self._last_end = time.perf_counter()
        if not self.enabled:
            return
        value = loss.detach().to(self._device, torch.float64).mean()
        self._loss_sum = value if self._loss_sum is None else self._loss_sum + value
        self._loss_count += 1

    @contextlib.contextmanager
    def optimizer_step(self, engine: Any) -> Iterator[None]:
        """Around the engine's optimizer step: the ``step`` phase, which also
        holds the monitor's own work (its ``monitor`` part); then the step's
        events, and the breakdown at print steps (:meth:`end_step`)."""
        with self.timers.phase("step"):
            self._grad_norm = self.grad_norm_before_step(engine) if self.enabled else None
            yield
            now = time.perf_counter()
            iteration = None if self._last_end is None else now - self._last_end
            self._last_end = now
            if self.enabled:
                self._write_step(engine, iteration)
                self.timers.add("monitor", time.perf_counter() - now)
        self.end_step(engine, iteration or 0.0)

    def end_step(self, engine: Any, iteration: float) -> None:
        """Close the step's times; at a print step, log and write the
        breakdown. That work cannot be in the interval it reports: it is
        added to the next step's ``step`` and ``monitor`` parts."""
        self.timers.end_step(iteration)
        if not self.timers.enabled or not every(engine.global_steps, self._print_every):
            return
        start = time.perf_counter()
        steps = self.timers.steps_pending
        means = self.timers.take_means()
        line = self.breakdown_line(means, steps) if means else None
        if line:
            log.info("%s", line)
        if self.rank == 0 and means:
            self.write_events([(ev.time_event(part), value, engine.global_samples)
                               for part, value in means.items()])
        spent = time.perf_counter() - start
        self.timers.add("step", spent)
        self.timers.add("monitor", spent)

    # ------------------------------------------------------ subclass hooks

    def grad_norm_before_step(self, engine: Any) -> Optional[float]:
        """The norm to write when the step itself reports none."""
        return measure_grad_norm(engine)

    def breakdown_line(self, means: dict[str, float], steps: int) -> Optional[str]:
        """The breakdown's log line on this rank (rank 0's only), or None."""
        return format_breakdown(means, steps) if self.rank == 0 else None

    # -------------------------------------------------------------- internals

    def _reduce_stats(self) -> tuple[Optional[float], int]:
        """(mean loss over micro-batches and ranks, tokens over ranks); resets."""
        stats = torch.tensor([0.0, float(self._loss_count), float(self._tokens)],
                             dtype=torch.float64, device=self._device)
        if self._loss_sum is not None:
            stats[0] += self._loss_sum
        self._loss_sum, self._loss_count, self._tokens = None, 0, 0
        if dist.get_world_size(self._group) > 1:
            collectives.all_reduce(stats, group=self._group)
        if self.rank != 0:
            return None, 0
        total, count, tokens = stats.tolist()
        return (total / count if count else None), int(tokens)

    def _write_step(self, engine: Any, iteration: Optional[float]) -> None:
        loss, tokens = self._reduce_stats()
        if self.rank != 0:
            return
        step = engine.global_samples
        events: list[tuple[str, float, int]] = []
        if loss is not None:
            events.append((ev.TRAIN_LOSS, loss, step))
        events += [(ev.lr_event(i), lr, step) for i, lr in enumerate(engine.get_lr())]
        if engine.precision.scaler is not None:
            events.append((ev.LOSS_SCALE, float(engine.precision.loss_scale), step))
        norm = engine.get_global_grad_norm()  # a tensor at ZeRO stages, as DeepSpeed's
        norm = self._grad_norm if norm is None else float(norm)
        if norm is not None and math.isfinite(norm):
            events.append((ev.GRAD_NORM, norm, step))
        if iteration:
            events.append((ev.SAMPLES_PER_SEC, self._batch / iteration, step))
            if self.seq_length is not None:
                tokens = self._batch * self.seq_length
            if tokens:
                events.append((ev.TOKENS_PER_SEC, tokens / iteration, step))
        self.write_events(events)
