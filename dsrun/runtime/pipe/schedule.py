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
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Instruction:
    """One step of a stage's schedule."""

    def __str__(self) -> str:
        fields = ", ".join(str(v) for v in self.__dict__.values())
        return f"{type(self).__name__}({fields})"


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
