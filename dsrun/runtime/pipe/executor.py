"""How a pipeline stage runs its schedule: one handler per instruction of
:mod:`~.schedule` (load a micro-batch, send and receive labels,
activations and gradients over :mod:`~.p2p`, forward, backward, the
data-parallel and tied-gradient reductions, the optimizer step), as a mixin
of :class:`~.engine.PipelineEngine`, which owns the public API.

``_run(program, state)`` executes a stage's instruction stream for one
batch; a batch that fails leaves no armed reduction and no partly
accumulated gradients behind. Each stage keeps its state per micro-batch
(:class:`~.batch.BatchState`): inputs until the gradient for them is sent,
outputs until their backward, the labels on the last stage. Errors inside
a layer or the loss function are annotated with the stage, its layers and
the micro-batch.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from collections.abc import Iterator
from typing import Any, Callable

import torch

from dsrun import checkpointing
from dsrun.errors import DsrunError
from dsrun.runtime.pipe import schedule as sched
from dsrun.runtime.pipe.batch import (
    BatchState,
    next_micro_batch,
    split_micro_batch,
    to_device,
)
from dsrun.runtime.pipe.errors import PipeAssertionError, PipeRuntimeError
from dsrun.runtime.pipe.losses import LossAggregator, add_additional
from dsrun.runtime.pipe.p2p import (
    Header,
    TensorMeta,
    check_metas,
    flatten_payload,
    recv_message,
    send_message,
)

log = logging.getLogger("dsrun.runtime")


def _annotate(exc: BaseException, note: str) -> None:
    """Say where in the pipeline ``exc`` happened (Python >= 3.11 shows notes)."""
    add_note = getattr(exc, "add_note", None)
    if add_note is not None:
        add_note(note)


def _needing_grads(inputs: Any) -> Any:
    """``inputs`` with each floating-point tensor a new leaf that requires grad."""
    if isinstance(inputs, torch.Tensor):
        return inputs.detach().requires_grad_() if inputs.is_floating_point() else inputs
    return type(inputs)(_needing_grads(t) for t in inputs)


def _stage_copy(inputs: Any) -> Any:
    """A copy of each input tensor that requires grad (a leaf: in-place
    operations on it would fail); gradients still reach the original."""
    if isinstance(inputs, torch.Tensor):
        return inputs.clone() if inputs.requires_grad else inputs
    return type(inputs)(_stage_copy(t) for t in inputs)


class InstructionExecutor:
    """The instruction handlers of :class:`~.engine.PipelineEngine` (module
    docstring); they use the engine's grid, module, precision and monitor."""

    # set by PipelineEngine / DsrunEngine
    grid: Any
    module: Any
    config: Any
    precision: Any
    monitor: Any
    optimizer: Any
    progress: Any
    device: torch.device
    stage_id: int
    num_stages: int
    zero_stage: int
    dp_world_size: int
    dp_group: Any
    _boundary_now: bool
    num_pipe_buffers: int
    total_loss: Any
    agg_train_loss: Any
    agg_additional_losses: Any
    _losses: LossAggregator
    last_batch_timing: Any
    batch_fn: Any
    _batches: int
    _pending: Any
    _grad_sync: Any
    _warned_no_grad: bool
    _handlers: dict[type, Callable[[Any, BatchState], None]]
    _profiling: Callable[..., Any]
    _take_model_step: Callable[[Any], Any]
    zero_grad: Callable[[], None]

    def _instruction_handlers(self) -> dict[type, Callable[[Any, BatchState], None]]:
        return {
            sched.LoadMicroBatch: self._load, sched.SendLabels: self._send_labels,
            sched.RecvLabels: self._recv_labels, sched.RecvActivation: self._recv_activation,
            sched.Forward: self._forward, sched.SendActivation: self._send_activation,
            sched.RecvGrad: self._recv_grad, sched.Backward: self._backward,
            sched.SendGrad: self._send_grad, sched.ReduceGrads: self._reduce_grads,
            sched.ReduceTiedGrads: self._reduce_tied_grads,
            sched.OptimizerStep: self._optimizer_step}

    # ------------------------------------------------------------ running

    def _new_batch(self, kind: str, micro_batches: int, source: Any) -> BatchState:
        self._batches += 1
        return BatchState(kind, self._batches, micro_batches, source)

    def _run(self, program: tuple[sched.Instruction, ...], state: BatchState) -> None:
        # DeepSpeed's count of pipeline buffers: here the most micro-batches
        # this stage has held at once (its state is kept per micro-batch)
        self.num_pipe_buffers = max(self.num_pipe_buffers, sched.peak_in_flight(program))
        start = time.perf_counter()
        try:
            for instruction in program:
                if isinstance(instruction, (sched.ReduceGrads, sched.OptimizerStep)) and \
                        not state.pipeline_s:
                    state.pipeline_s = time.perf_counter() - start
                with self.monitor.instruction(instruction, state.kind):
                    self._handlers[type(instruction)](instruction, state)
            with self.monitor.sends(state.kind):
                self._pending.wait_all()
        except BaseException:
            # a failed batch leaves nothing behind: no armed reduction, no
            # partly accumulated gradients for the next batch to add to
            if self._grad_sync is not None:
                self._grad_sync.disarm()
            if state.kind == "train":
                self.zero_grad()
            raise
        if not state.pipeline_s:
            state.pipeline_s = time.perf_counter() - start
        self.last_batch_timing = {"pipeline_s": state.pipeline_s, "compute_s": state.compute_s,
                                  "total_s": time.perf_counter() - start}

    def _reentrant_checkpointing(self) -> bool:
        """Whether this stage's activation checkpoint is a reentrant one (as
        DeepSpeed decides: anything but the non-reentrant function, here
        also a ``partial(..., use_reentrant=False)``)."""
        module = self.module
        if module.activation_checkpoint_interval <= 0:
            return False
        func = module.activation_checkpoint_func
        if func is checkpointing.checkpoint:
            return False
        return not (isinstance(func, functools.partial)
                    and func.keywords.get("use_reentrant") is False)

    def _where(self, micro_batch: int) -> str:
        a, b = self.module.layer_range
        return f"pipeline stage {self.stage_id} (layers {a}-{b - 1}), micro-batch {micro_batch}"

    def _send(self, kind: str, channel: Any, micro_batch: int, batch: int,
              tensors: list[torch.Tensor], is_tuple: bool = False) -> list[TensorMeta]:
        metas = tuple(TensorMeta.of(t) for t in tensors)
        header = Header(kind, batch, micro_batch, metas, is_tuple)
        send_message(channel, header, tensors, self._pending, self.device)
        return list(metas)

    def _receive(self, kind: str, channel: Any, micro_batch: int, batch: int
                 ) -> tuple[Header, list[torch.Tensor]]:
        where = f"{self._where(micro_batch)}, receiving on channel '{channel.name}',"
        return recv_message(channel, self.device, kind, batch, micro_batch, where)

    # ------------------------------------------------------------ data and labels

    def _load(self, ins: sched.LoadMicroBatch, state: BatchState) -> None:
        k = ins.micro_batch
        item = next_micro_batch(state.source, k, state.micro_batches)
        if self.batch_fn is not None:
            item = self.batch_fn(item)
        inputs, labels = split_micro_batch(item, k)
        # DeepSpeed asserts the inputs are tensors
        flatten_payload(inputs, f"the inputs of micro-batch {k}", PipeAssertionError)
        if state.kind == "train":  # tokens/s: counts a (batch, seq) integer first input
            self.monitor.saw_inputs(inputs if isinstance(inputs, (tuple, list)) else (inputs,),
                                    {})
        inputs = self.precision.cast_inputs(to_device(inputs, self.device))
        if state.kind == "train" and self._reentrant_checkpointing():
            inputs = _needing_grads(inputs)  # or the first checkpointed chunk is cut off
        state.inputs[k] = inputs
        state.labels[k] = to_device(labels, self.device)

    def _send_labels(self, ins: sched.SendLabels, state: BatchState) -> None:
        k = ins.micro_batch
        labels = state.labels.pop(k)
        tensors, is_tuple = flatten_payload(labels, f"the labels of micro-batch {k}")
        channel = self.grid.channel("labels", 0, self.num_stages - 1)
        self._send("labels", channel, k, state.batch, tensors, is_tuple)

    def _recv_labels(self, ins: sched.RecvLabels, state: BatchState) -> None:
        channel = self.grid.channel("labels", 0, self.num_stages - 1)
        header, tensors = self._receive("labels", channel, ins.micro_batch, state.batch)
        state.labels[ins.micro_batch] = tuple(tensors) if header.is_tuple else tensors[0]

    # ------------------------------------------------------------ activations

    def _recv_activation(self, ins: sched.RecvActivation, state: BatchState) -> None:
        channel = self.grid.channel("act", self.stage_id - 1, self.stage_id)
        header, tensors = self._receive(state.activation_kind, channel, ins.micro_batch,
                                        state.batch)
        if state.kind == "train":
            # a reentrant checkpoint needs its floating-point inputs to require
            # grad (as DeepSpeed marks them); only those the sender asked for go back
            every_float = self._reentrant_checkpointing()
            for tensor, meta in zip(tensors, header.metas):
                tensor.requires_grad_(meta.requires_grad or (
                    every_float and tensor.is_floating_point()))
            state.wanted[ins.micro_batch] = [m.requires_grad for m in header.metas]
        state.inputs[ins.micro_batch] = tuple(tensors) if header.is_tuple else tensors[0]

    def _forward(self, ins: sched.Forward, state: BatchState) -> None:
        k = ins.micro_batch
        start = time.perf_counter()
        keep = state.kind == "train" and not self.grid.is_first_stage  # until SendGrad
        inputs = state.inputs[k] if keep else state.inputs.pop(k)
        if state.kind == "train":
            inputs = _stage_copy(inputs)  # in-place layers (ReLU(inplace=True)) may run on it
        try:
            with self.precision.autocast(), self._profiling("forward", (inputs,), {}):
                outputs = self.module(inputs)
        except Exception as exc:
            _annotate(exc, f"(in the forward pass of {self._where(k)})")
            raise
        if self.grid.is_last_stage:
            self._last_stage_outputs(k, outputs, state)
        else:
            state.outputs[k] = outputs
        state.compute_s += time.perf_counter() - start

    def _last_stage_outputs(self, k: int, outputs: Any, state: BatchState) -> None:
        if state.keep_outputs:
            state.results[:] = [outputs]  # the last micro-batch's, as DeepSpeed
        loss_fn = self.module.loss_fn
        if state.compute_loss and loss_fn is not None:
            try:
                loss = loss_fn(outputs, state.labels.pop(k))
            except Exception as exc:
                _annotate(exc, f"(in loss_fn on {self._where(k)})")
                raise
        else:
            loss = outputs
        if state.kind == "train":
            if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
                raise PipeRuntimeError(self._not_a_loss(k, loss))
            state.losses[k] = loss
            state.loss_values.append(loss.detach().float().reshape(()))
            # DeepSpeed's: the sum of this batch's micro-batch losses (last stage)
            self.total_loss = loss.detach().clone() if self.total_loss is None else \
                self.total_loss + loss.detach()
            # DeepSpeed's hook, asked after each forward of the last stage
            state.additional = add_additional(state.additional,
                                              self.module.get_additional_losses(),
                                              self._where(k))
            return
        parts = loss if isinstance(loss, (tuple, list)) else (loss,)
        if not all(isinstance(t, torch.Tensor) for t in parts):
            raise DsrunError(self._not_a_loss(k, loss))
        state.loss_values.append(loss)

    def _not_a_loss(self, k: int, loss: Any) -> str:
        what = f"a tensor of shape {list(loss.shape)}" if isinstance(loss, torch.Tensor) \
            else f"a {type(loss).__name__}"
        source = "loss_fn returned" if self.module.loss_fn is not None else \
            "without loss_fn, the last layer's output is the loss, and it is"
        need = "a single-element tensor" if isinstance(loss, torch.Tensor) else \
            "a tensor (or, in eval_batch, a tuple of tensors)"
        return f"{self._where(k)}: {source} {what}; the loss must be {need}"

    def _send_activation(self, ins: sched.SendActivation, state: BatchState) -> None:
        k = ins.micro_batch
        outputs = state.outputs[k] if state.kind == "train" else state.outputs.pop(k)
        tensors, is_tuple = flatten_payload(outputs, f"the output of {self._where(k)}")
        channel = self.grid.channel("act", self.stage_id, self.stage_id + 1)
        metas = self._send(state.activation_kind, channel, k, state.batch, tensors, is_tuple)
        state.sent[k] = [m for m in metas if m.requires_grad]
        if state.kind == "train" and not state.sent[k] and not self._warned_no_grad and \
                any(p.requires_grad for p in self.module.parameters()):
            self._warned_no_grad = True
            log.warning("%s: no output of this stage requires grad, so its parameters get no "
                        "gradient (a reentrant activation checkpoint whose inputs do not "
                        "require grad does this: use the default, non-reentrant one)",
                        self._where(k))

    # ------------------------------------------------------------ gradients

    def _recv_grad(self, ins: sched.RecvGrad, state: BatchState) -> None:
        k = ins.micro_batch
        channel = self.grid.channel("grad", self.stage_id + 1, self.stage_id)
        header, tensors = self._receive("gradient", channel, k, state.batch)
        check_metas(header.metas, state.sent.pop(k), self._where(k))
        state.grads[k] = tensors

    def _backward(self, ins: sched.Backward, state: BatchState) -> None:
        k = ins.micro_batch
        start = time.perf_counter()
        sync = ins.reduce_grads and self._grad_sync is not None
        if sync:
            self._grad_sync.arm()
        if self.grid.is_last_stage:
            loss = state.losses.pop(k)
            if state.micro_batches > 1:
                loss = loss / state.micro_batches
            with self._profiling("backward"):
                self.precision.scale_loss(loss).backward()
        else:
            tensors, _ = flatten_payload(state.outputs.pop(k), f"the output of "
                                         f"{self._where(k)}")
            outputs = [t for t in tensors if t.requires_grad]
            grads = state.grads.pop(k)
            if outputs:
                with self._profiling("backward"):
                    torch.autograd.backward(outputs, grads)
        if self.zero_stage > 0:
            self.optimizer.micro_step_done()
        state.compute_s += time.perf_counter() - start

    def _send_grad(self, ins: sched.SendGrad, state: BatchState) -> None:
        k = ins.micro_batch
        tensors, _ = flatten_payload(state.inputs.pop(k), f"the input of {self._where(k)}")
        grads = [t.grad if t.grad is not None else torch.zeros_like(t)
                 for t, wanted in zip(tensors, state.wanted.pop(k)) if wanted]
        channel = self.grid.channel("grad", self.stage_id, self.stage_id - 1)
        self._send("gradient", channel, k, state.batch, grads)

    @contextlib.contextmanager
    def _at_boundary(self) -> Iterator[None]:
        """``is_gradient_accumulation_boundary()`` is True inside (DeepSpeed's
        pipeline answer: while it reduces the gradients or steps)."""
        self._boundary_now = True
        try:
            yield
        finally:
            self._boundary_now = False

    def _reduce_grads(self, ins: sched.ReduceGrads, state: BatchState) -> None:
        with self._at_boundary():
            if self._grad_sync is not None:
                with self.monitor.comm_wait("reduce"):
                    self._grad_sync.finish()

    def _reduce_tied_grads(self, ins: sched.ReduceTiedGrads, state: BatchState) -> None:
        self.module.tied_weights.reduce_grads()

    # ------------------------------------------------------------ the step

    def _aggregate_loss(self, state: BatchState) -> torch.Tensor:
        """The training batch's mean loss over micro-batches and replicas, on
        every rank; the additional losses likewise (``agg_additional_losses``)."""
        count = state.micro_batches
        if self.grid.is_last_stage and len(state.loss_values) != count:
            raise DsrunError(f"{self._where(count - 1)}: {len(state.loss_values)} losses for "
                             f"{count} micro-batches")
        loss, self.agg_additional_losses = self._losses.reduce(
            state.loss_values, state.additional, count)
        return loss

    def _optimizer_step(self, ins: sched.OptimizerStep, state: BatchState) -> None:
        # micro_steps stays put, as in DeepSpeed: it counts engine.step()
        # calls, which a pipeline never makes (global_steps counts batches)
        with self.monitor.optimizer_step(self), self._at_boundary():  # events, breakdown
            self.agg_train_loss = self._aggregate_loss(state)
            self.progress.record_loss(self.agg_train_loss, self.agg_additional_losses)
            self.monitor.record_loss(self.agg_train_loss)
            with self._profiling("step"):
                self._take_model_step(None)
