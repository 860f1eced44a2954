"""Pipeline schedules as instruction streams (pure, no torch).

A schedule is, for one stage, the exact sequence of things that stage does
for one batch of ``micro_batches`` micro-batches; the
:class:`~dsrun.runtime.pipe.engine.PipelineEngine` executes it one
instruction at a time. Sends never block (they are posted and completed
later); receives block until the matching message arrives. Messages
between two stages in one direction arrive in the order they were sent.

**Training (1F1B)**, :func:`train_schedule`: stage ``s`` of ``S`` first runs
``min(S - s - 1, M)`` forward passes (warm-up), then alternates one forward
and one backward until every micro-batch has been forwarded, then runs the
remaining backward passes (cool-down); backward passes go in micro-batch
order. At most ``S - s`` micro-batches are in flight on stage ``s``
(forwarded, not yet backwarded): the activations kept are bounded by the
pipeline depth, not by ``M`` as in GPipe's all-forward-then-all-backward.
With unit-time passes and free communication the batch takes
``(M + S - 1) * (forward + backward)``: every stage is busy for ``M`` of
those slots, the ideal efficiency ``M / (M + S - 1)``.

The first stage reads each micro-batch (:class:`LoadMicroBatch`) and sends
its labels straight to the last stage (:class:`SendLabels`), which receives
them just before that micro-batch's forward: labels travel with their
micro-batch id and are never read twice from a data iterator. The last
backward also starts the data-parallel gradient reduction (overlapped with
it); the batch ends with :class:`ReduceGrads`, :class:`ReduceTiedGrads` and
:class:`OptimizerStep`.

**Inference**, :func:`inference_schedule`: forward passes in micro-batch
order, streamed through the stages.

Invariants (tested by simulating all stages together): every micro-batch is
forwarded and backwarded once per stage, in dependency order; every receive
gets the message of the micro-batch it names; no stage ever waits forever.

**DeepSpeed's names.** :class:`TrainSchedule` and :class:`InferenceSchedule`
(subclasses of :class:`PipeSchedule`) iterate over the same programs cut
into steps (:func:`program_steps`); ``PipeInstruction``, ``ForwardPass``
and ``BackwardPass`` are :class:`Instruction`, :class:`Forward` and
:class:`Backward`. Two differences: an instruction names its micro-batch
(``micro_batch``), not a buffer slot (DeepSpeed's ``buffer_id``), and a
step is one pass with its communication, so there are no idle steps. The
engine runs :func:`train_schedule` and :func:`inference_schedule` itself:
a ``PipeSchedule`` subclass does not change what it runs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Optional


@dataclass(frozen=True)
class Instruction:
    """One step of a stage's schedule."""

    def __str__(self) -> str:
        fields = ", ".join(str(v) for v in self.__dict__.values())
        return f"{type(self).__name__}({fields})"

    @property
    def name(self) -> str:
        """The instruction's class name (DeepSpeed's ``PipeInstruction.name``)."""
        return type(self).__name__

    @property
    def kwargs(self) -> dict[str, Any]:
        """The instruction's fields by name (DeepSpeed's ``PipeInstruction.kwargs``)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


@dataclass(frozen=True)
class MicroBatchInstruction(Instruction):
    micro_batch: int


class LoadMicroBatch(MicroBatchInstruction):
    """First stage: take the next micro-batch ``(inputs, labels)`` from the data iterator."""


class SendLabels(MicroBatchInstruction):
    """First stage: send the micro-batch's labels to the last stage."""


class RecvLabels(MicroBatchInstruction):
    """Last stage: receive the micro-batch's labels from the first stage."""


class RecvActivation(MicroBatchInstruction):
    """Receive the previous stage's output for the micro-batch."""


class Forward(MicroBatchInstruction):
    """Run this stage's layers (the last stage also computes the loss)."""


class SendActivation(MicroBatchInstruction):
    """Send this stage's output to the next stage."""


class RecvGrad(MicroBatchInstruction):
    """Receive the gradient of this stage's output from the next stage."""


@dataclass(frozen=True)
class Backward(MicroBatchInstruction):
    """Backward pass of the micro-batch; ``reduce_grads``: it completes the
    gradient accumulation, so the data-parallel reduction starts during it."""

    reduce_grads: bool = False


class SendGrad(MicroBatchInstruction):
    """Send the gradient of this stage's input to the previous stage."""


class ReduceGrads(Instruction):
    """Finish the data-parallel gradient reduction (within the stage's group)."""


class ReduceTiedGrads(Instruction):
    """Sum the gradients of tied weights over the stages that hold them."""


class OptimizerStep(Instruction):
    """Clip by the norm over all stages, step, advance the LR schedule."""


def _check(stages: int, micro_batches: int, stage: int) -> None:
    for name, value, low in (("stages", stages, 1), ("micro_batches", micro_batches, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
    if isinstance(stage, bool) or not isinstance(stage, int) or not 0 <= stage < stages:
        raise ValueError(f"stage must be in [0, {stages}), got {stage!r}")


def _forward(k: int, stage: int, stages: int, labels: bool) -> list[Instruction]:
    first, last = stage == 0, stage == stages - 1
    out: list[Instruction] = []
    if first:
        out.append(LoadMicroBatch(k))
        if labels and not last:
            out.append(SendLabels(k))
    else:
        out.append(RecvActivation(k))
        if labels and last:
            out.append(RecvLabels(k))
    out.append(Forward(k))
    if not last:
        out.append(SendActivation(k))
    return out


def _backward(k: int, stage: int, stages: int, micro_batches: int) -> list[Instruction]:
    out: list[Instruction] = []
    if stage < stages - 1:
        out.append(RecvGrad(k))
    out.append(Backward(k, reduce_grads=k == micro_batches - 1))
    if stage > 0:
        out.append(SendGrad(k))
    return out


def train_schedule(stages: int, micro_batches: int, stage: int, labels: bool = True
                   ) -> tuple[Instruction, ...]:
    """The 1F1B training schedule of ``stage`` (module docstring).
    ``labels`` False: the loss needs no labels (none are sent)."""
    _check(stages, micro_batches, stage)
    warmup = min(stages - stage - 1, micro_batches)
    out: list[Instruction] = []
    forwarded = backwarded = 0
    for _ in range(warmup):
        out += _forward(forwarded, stage, stages, labels)
        forwarded += 1
    while forwarded < micro_batches:
        out += _forward(forwarded, stage, stages, labels)
        forwarded += 1
        out += _backward(backwarded, stage, stages, micro_batches)
        backwarded += 1
    while backwarded < micro_batches:
        out += _backward(backwarded, stage, stages, micro_batches)
        backwarded += 1
    out += [ReduceGrads(), ReduceTiedGrads(), OptimizerStep()]
    return tuple(out)


def inference_schedule(stages: int, micro_batches: int, stage: int, labels: bool = True
                       ) -> tuple[Instruction, ...]:
    """Forward passes only, streamed (module docstring); ``labels``: the
    last stage computes a loss and needs them."""
    _check(stages, micro_batches, stage)
    out: list[Instruction] = []
    for k in range(micro_batches):
        out += _forward(k, stage, stages, labels)
    return tuple(out)


# ---------------------------------------------------------------- DeepSpeed's names

PipeInstruction = Instruction
# DeepSpeed's base of the instructions on a buffer slot; here they name their
# micro-batch (imported by Megatron-DeepSpeed's own schedules, which dsrun's
# engine does not run: it runs train_schedule/inference_schedule)
BufferOpInstruction = MicroBatchInstruction
ForwardPass = Forward
BackwardPass = Backward
_PASSES = (Forward, Backward)
_AFTER_A_PASS = (SendActivation, SendGrad, ReduceGrads, ReduceTiedGrads, OptimizerStep)


def program_steps(program: tuple[Instruction, ...]) -> list[list[Instruction]]:
    """``program`` cut into steps: each holds one forward or backward pass,
    the loads and receives before it and the sends after it; the batch's
    closing reductions and optimizer step join the last step (as in
    DeepSpeed). Joined again, the steps are ``program``."""
    steps: list[list[Instruction]] = []
    current: list[Instruction] = []
    has_pass = False
    for ins in program:
        if has_pass and not isinstance(ins, _AFTER_A_PASS):
            steps.append(current)
            current, has_pass = [], False
        current.append(ins)
        has_pass = has_pass or isinstance(ins, _PASSES)
    if current:
        steps.append(current)
    return steps


def peak_in_flight(program: tuple[Instruction, ...]) -> int:
    """The most micro-batches a stage running ``program`` holds at once:
    forwarded and not yet backwarded (training), or one at a time (forward
    passes only); 0 for a program without passes."""
    held = peak = 0
    for ins in program:
        if isinstance(ins, Forward):
            held += 1
            peak = max(peak, held)
        elif isinstance(ins, Backward):
            held -= 1
    if not any(isinstance(ins, Backward) for ins in program):
        return min(peak, 1)
    return peak


class PipeSchedule:
    """DeepSpeed's schedule interface: iterating gives the steps (lists of
    instructions) of one batch of ``micro_batches`` on ``stage_id`` of
    ``stages``. Subclasses define :meth:`steps`."""

    def __init__(self, micro_batches: int, stages: int, stage_id: int) -> None:
        self.micro_batches = micro_batches
        self.stages = stages
        self.stage_id = stage_id
        self.prev_stage = stage_id - 1
        self.next_stage = stage_id + 1
        self._it: Optional[Iterator[list[Instruction]]] = None

    def steps(self) -> Iterator[list[Instruction]]:
        raise NotImplementedError(f"{type(self).__name__} must define steps()")

    def num_pipe_buffers(self) -> int:
        """The most micro-batches this stage holds at once (an upper bound
        here: all of them; subclasses give the exact number)."""
        return self.micro_batches

    @property
    def stage(self) -> int:
        return self.stage_id

    @property
    def num_stages(self) -> int:
        return self.stages

    @property
    def num_micro_batches(self) -> int:
        return self.micro_batches

    @property
    def is_first_stage(self) -> bool:
        return self.stage_id == 0

    @property
    def is_last_stage(self) -> bool:
        return self.stage_id == self.stages - 1

    def __iter__(self) -> PipeSchedule:
        self._it = None
        return self

    def __next__(self) -> list[Instruction]:
        if self._it is None:
            self._it = self.steps()
        return next(self._it)


class _ProgramSchedule(PipeSchedule):
    """A schedule whose steps are a program of this module, cut by
    :func:`program_steps`; ``labels`` as for the program."""

    def __init__(self, micro_batches: int, stages: int, stage_id: int,
                 labels: bool = True) -> None:
        super().__init__(micro_batches, stages, stage_id)
        self.labels = labels
        self.program = self._make(stages, micro_batches, stage_id, labels)

    @staticmethod
    def _make(stages: int, micro_batches: int, stage: int, labels: bool
              ) -> tuple[Instruction, ...]:
        raise NotImplementedError

    def steps(self) -> Iterator[list[Instruction]]:
        yield from program_steps(self.program)

    def num_pipe_buffers(self) -> int:
        return peak_in_flight(self.program)


class TrainSchedule(_ProgramSchedule):
    """The 1F1B training schedule (:func:`train_schedule`) as steps."""

    _make = staticmethod(train_schedule)


class InferenceSchedule(_ProgramSchedule):
    """The forward-only schedule (:func:`inference_schedule`) as steps."""

    _make = staticmethod(inference_schedule)
