"""A pipeline engine's metrics: DeepSpeed's monitor events per optimizer
step, and a wall-clock breakdown made for a pipeline.

:class:`PipelineMonitor` is a pipeline engine's ``engine.monitor``: the
plain engine's :class:`~dsrun.runtime.monitor.training.EngineMonitor`
(same sections, same ``write_events``, same events and CSV layout), fed
by ``train_batch`` instead of forward/backward/step. Per optimizer step
rank 0 - the first stage of the first replica - writes:

* ``train_loss``: the loss ``train_batch`` returned (the mean over the
  batch's micro-batches and the replicas, already on every rank: the
  monitor's all-reduce of it over the stage's data-parallel group gives it
  back unchanged);
* ``lr`` per param group, ``loss_scale`` (fp16);
* ``grad_norm``: the step's own norm when clipping or fp16 computes it,
  else measured inside the step over all stages for the monitor alone
  (one scalar all-reduce over the world, as clipping does);
  ``get_global_grad_norm()`` still says None then, as DeepSpeed's;
* ``samples_per_sec``, and ``tokens_per_sec`` from ``seq_length`` or from
  the first stage's micro-batch inputs (a 2-D integer tensor, or the first
  tensor of a tuple), counted on every replica.

``eval_batch`` writes ``Train/Samples/eval_loss``, as DeepSpeed's pipeline
engine does.

**Breakdown.** With ``wall_clock_breakdown``, each instruction of a
training batch's schedule is timed as one part, so the parts add up to the
time of ``train_batch``:

* ``LoadMicroBatch`` -> ``batch_input`` (first stage);
* ``RecvActivation``, ``RecvLabels`` -> ``pipe_recv_input``;
* ``RecvGrad`` -> ``pipe_recv_grad``;
* the ``Send*`` and the end-of-batch wait for posted sends -> ``pipe_send``;
* ``Forward`` (with the loss on the last stage) -> ``forward``;
* ``Backward`` -> ``backward`` (its ``backward_inner``), ``ReduceGrads``
  -> ``backward`` too (the wait is ``backward_allreduce``, DeepSpeed's
  split);
* ``ReduceTiedGrads`` -> ``tied_reduce``;
* ``OptimizerStep`` -> ``step``: the batch's loss from the last stage, the
  step with the norm over all stages, and the monitor's own work.

A step's times are closed once its batch has waited for its posted sends
(:meth:`PipelineMonitor.batch_finished`), so each step's parts hold the
time of its own ``train_batch`` call. The receive waits are where a stage
sits idle in the pipeline's bubble.
Evaluation batches and ``engine(inputs)`` are not timed (they show in
``iteration`` only). The stages' times differ, so every stage's first
replica logs its own line (with its busy share: passes over the schedule's
time, against the 1F1B ideal ``m / (m + s - 1)``); rank 0 writes its own
as the ``elapsed_time_ms_<part>`` events.
"""

from __future__ import annotations

import contextlib
import time
from contextlib import AbstractContextManager as ContextManager
from typing import Any, Optional

import torch

from dsrun.runtime.monitor import events as ev
from dsrun.runtime.monitor.training import EngineMonitor
from dsrun.runtime.pipe import schedule as sched

INSTRUCTION_PARTS: dict[type, str] = {
    sched.LoadMicroBatch: "batch_input", sched.RecvActivation: "pipe_recv_input",
    sched.RecvLabels: "pipe_recv_input", sched.RecvGrad: "pipe_recv_grad",
    sched.SendActivation: "pipe_send", sched.SendGrad: "pipe_send",
    sched.SendLabels: "pipe_send", sched.Forward: "forward", sched.Backward: "backward",
    sched.ReduceGrads: "backward", sched.ReduceTiedGrads: "tied_reduce",
}  # OptimizerStep: the monitor's optimizer_step times it as "step"
_NULL: ContextManager[None] = contextlib.nullcontext()


def busy_share(means: dict[str, float]) -> float:
    """Passes over the schedule's time: forward and backward compute against
    them plus reading data, waiting for the neighbours and sending."""
    busy = means["forward"] + means["backward_inner"]
    waits = sum(means[p] for p in ("batch_input", "pipe_recv_input", "pipe_recv_grad",
                                   "pipe_send"))
    return busy / (busy + waits) if busy + waits > 0 else 0.0


def format_pipeline_breakdown(stage: int, means: dict[str, float], steps: int,
                              ideal: float) -> str:
    """One stage's log line (ms per optimizer step, mean of ``steps``)."""
    m = means
    parts = [f"input {m['batch_input']:.2f}", f"forward {m['forward']:.2f}",
             f"backward {m['backward']:.2f} (data-parallel reduce wait "
             f"{m['backward_allreduce']:.2f})",
             f"receive wait {m['pipe_recv_input'] + m['pipe_recv_grad']:.2f} (activations "
             f"{m['pipe_recv_input']:.2f}, gradients {m['pipe_recv_grad']:.2f})",
             f"send {m['pipe_send']:.2f}", f"tied reduce {m['tied_reduce']:.2f}",
             f"step {m['step']:.2f} (monitor {m['monitor']:.2f})",
             f"iteration {m['iteration']:.2f}"]
    return (f"pipeline stage {stage}: time (ms per optimizer step, mean of {steps}): "
            + " | ".join(parts) + f"; busy {100 * busy_share(m):.0f}% "
            f"(1F1B ideal {100 * ideal:.0f}%)")


class PipelineMonitor(EngineMonitor):
    """``engine.monitor`` of a pipeline engine (module docstring)."""

    PARTS = ev.PIPELINE_PARTS

    def __init__(self, config: Any, *, rank: int, group: Any, device: torch.device,
                 stage: int, stages: int, replica: int) -> None:
        super().__init__(config, rank=rank, group=group, device=device)
        self.stage = stage
        self._logs = replica == 0
        self._stages = stages
        self._ideal = self._ideal_busy(config.gradient_accumulation_steps)
        self._open_step: Optional[tuple[Any, float]] = None  # (engine, iteration)

    def _ideal_busy(self, micro_batches: int) -> float:
        return micro_batches / (micro_batches + self._stages - 1)

    def set_batch(self, config: Any) -> None:
        super().set_batch(config)
        self._ideal = self._ideal_busy(config.gradient_accumulation_steps)

    # ------------------------------------------------ what train_batch calls

    def batch_started(self) -> None:
        """The first batch starts the first step's wall time (samples/s)."""
        if self._last_end is None:
            self._last_end = time.perf_counter()

    def batch_finished(self) -> None:
        """The batch's sends are complete: close its step's times."""
        open_step, self._open_step = self._open_step, None
        if open_step is not None:
            super().end_step(*open_step)

    def instruction(self, instruction: Any, kind: str) -> ContextManager[None]:
        """Time one instruction of a training batch under its part."""
        part = INSTRUCTION_PARTS.get(type(instruction))
        if part is None or kind != "train":
            return _NULL
        return self.timers.phase(part)

    def sends(self, kind: str) -> ContextManager[None]:
        """Time the end-of-batch wait for the posted sends."""
        return self.timers.phase("pipe_send") if kind == "train" else _NULL

    def note_grad_norm(self, norm: Optional[torch.Tensor]) -> None:
        """The norm the step measured for the monitor alone (module docstring)."""
        self._grad_norm = None if norm is None else float(norm)

    def write_eval_loss(self, loss: Any, samples: int) -> None:
        """``eval_batch``'s loss (a tensor, or one per micro-batch) as eval_loss."""
        if isinstance(loss, (list, tuple)):
            loss = torch.stack(list(loss)).mean() if loss else None
        if loss is not None:
            self.write_events([(ev.EVAL_LOSS, loss, samples)])

    # ------------------------------------------------ EngineMonitor's hooks

    def end_step(self, engine: Any, iteration: float) -> None:
        self.batch_finished()  # a batch that failed after its step: close it now
        self._open_step = (engine, iteration)

    def grad_norm_before_step(self, engine: Any) -> Optional[float]:
        return None  # the pipeline step measures it over all stages (note_grad_norm)

    def breakdown_line(self, means: dict[str, float], steps: int) -> Optional[str]:
        if not self._logs:
            return None
        return format_pipeline_breakdown(self.stage, means, steps, self._ideal)
