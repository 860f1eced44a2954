"""``PipelineEngine``: trains a :class:`~.module.PipelineModule` batch by batch.

``dsrun.initialize(model=pipeline_module, config=...)`` builds it. Then::

    loss = engine.train_batch(data_iter)   # gradient_accumulation_steps micro-batches
    loss = engine.eval_batch(data_iter)    # the same number, forward only
    out = engine(inputs)                   # one forward through all stages

``train_batch`` runs this stage's 1F1B schedule (:mod:`~.schedule`) one
instruction at a time - data, sends and receives (:mod:`~.p2p`), passes,
the data-parallel and tied-gradient reductions and the optimizer step - and
returns the batch's loss on **every** rank: the mean over its micro-batches
and over the data-parallel replicas (what one process training on the
whole global batch would report). Only the first stage reads ``data_iter``
(each micro-batch a pair ``(inputs, labels)``); labels reach the last stage
with their micro-batch id. Every rank of the job calls the same methods in
the same order, as with any collective.

``engine(inputs)`` is an inference pass (no gradients): the first stage
uses ``inputs`` (other stages' argument is ignored), the output comes back
on the last stage and ``None`` elsewhere. ``engine.backward()`` and
``engine.step()`` raise: a pipeline cannot run one micro-batch's backward
in isolation, ``train_batch`` does forward, backward and step together.

On top of :class:`~dsrun.runtime.engine.DsrunEngine` (which here sees the
stage's data-parallel group as its group: broadcast of initial weights,
gradient averaging at ZeRO stage 0, partitioning at stages 1-2), this
engine adds the tied-weight broadcast and reduction, the cross-stage
gradient norm (:mod:`~.step`) and the schedules. ZeRO stage 1 works with
pipelines, stage 2 when no tied weights span stages; stage 3 is refused.

``engine.monitor`` (:mod:`~.metrics`) writes the plain engine's monitor
events per ``train_batch`` and times each schedule instruction for
``wall_clock_breakdown``.

``save_checkpoint`` / ``load_checkpoint`` are the engine's (DeepSpeed's
signatures and guarantees); :mod:`~.checkpoint` tells the checkpoint
package what each stage's ranks hold, so a pipeline checkpoint is keyed by
the one-stage model's names and loads into any number of stages or
replicas. After a load, ``train_batch()`` without a data iterator reads
the engine's dataloader from the loaded position.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Iterator
from typing import Any, Callable, Optional

import torch

from dsrun import comm as collectives
from dsrun.errors import DsrunConfigError, DsrunError
from dsrun.runtime.config import DsrunConfig
from dsrun.runtime.engine import DsrunEngine
from dsrun.runtime.pipe import schedule as sched
from dsrun.runtime.pipe.batch import (
    BatchState,
    next_micro_batch,
    repeat,
    split_micro_batch,
    to_device,
)
from dsrun.runtime.pipe.checkpoint import PipelineLayout, save_16bit_model
from dsrun.runtime.pipe.metrics import PipelineMonitor
from dsrun.runtime.pipe.module import PipelineModule
from dsrun.runtime.pipe.p2p import (
    Header,
    PendingSends,
    TensorMeta,
    check_metas,
    flatten_payload,
    recv_message,
    send_message,
)
from dsrun.runtime.pipe.step import check_pipeline_zero, pipeline_step
from dsrun.runtime.precision import StepResult

log = logging.getLogger("dsrun.runtime")

_TRAIN_ONLY = ("engine.{name}() is not how a pipeline trains: engine.train_batch(data_iter) "
               "runs forward, backward and the optimizer step of all "
               "gradient_accumulation_steps micro-batches through the stages together")


def _annotate(exc: BaseException, note: str) -> None:
    """Say where in the pipeline ``exc`` happened (Python >= 3.11 shows notes)."""
    add_note = getattr(exc, "add_note", None)
    if add_note is not None:
        add_note(note)


class PipelineEngine(DsrunEngine):
    """Pipeline-parallel training engine (module docstring)."""

    is_pipe_parallel = True

    def __init__(self, model: PipelineModule, config: DsrunConfig, *, mpu: Any = None,
                 **kwargs: Any) -> None:
        if not isinstance(model, PipelineModule):
            raise DsrunConfigError(f"PipelineEngine needs a PipelineModule, got "
                                   f"{type(model).__name__}")
        if mpu is not None and mpu is not model.grid:
            raise DsrunConfigError("a PipelineModule brings its own topology (num_stages= "
                                   "or topology=): do not pass mpu= to dsrun.initialize()")
        check_pipeline_zero(config, model)
        super().__init__(model, config, mpu=model.grid, **kwargs)
        self.grid = model.grid
        self.stage_id = self.grid.stage_id
        self.num_stages = self.grid.stages
        self.agg_train_loss: Optional[torch.Tensor] = None
        self.agg_eval_loss: Optional[torch.Tensor] = None
        self.last_batch_timing: Optional[dict[str, float]] = None
        self._batches = 0
        self._pending = PendingSends()
        self._data_iterator: Optional[Iterator[Any]] = None
        self._iterating_loader = False  # _data_iterator repeats training_dataloader
        self._batch_fn: Optional[Callable[[Any], Any]] = None
        self._handlers: dict[type, Callable[[Any, BatchState], None]] = {
            sched.LoadMicroBatch: self._load, sched.SendLabels: self._send_labels,
            sched.RecvLabels: self._recv_labels, sched.RecvActivation: self._recv_activation,
            sched.Forward: self._forward, sched.SendActivation: self._send_activation,
            sched.RecvGrad: self._recv_grad, sched.Backward: self._backward,
            sched.SendGrad: self._send_grad, sched.ReduceGrads: self._reduce_grads,
            sched.ReduceTiedGrads: self._reduce_tied_grads,
            sched.OptimizerStep: self._optimizer_step}
        if self.micro_batches < self.num_stages and self.global_rank == 0:
            log.info("pipeline: %d micro-batch(es) per batch for %d stages: at most %.0f%% "
                     "of each stage's time is busy (raise gradient_accumulation_steps)",
                     self.micro_batches, self.num_stages,
                     100 * self.micro_batches / (self.micro_batches + self.num_stages - 1))

    # ------------------------------------------------------------ set-up

    def _broadcast_state(self) -> None:
        super()._broadcast_state()
        self.module.tied_weights.broadcast()

    def _zero_accumulation(self) -> int:
        # Stage 1 reduces at the end of the batch, after the tied gradients
        # are summed (with accumulation 1 it would reduce during backward).
        return max(2, self.config.gradient_accumulation_steps)

    def _make_monitor(self) -> PipelineMonitor:
        grid = self.module.grid  # self.grid is set after the base constructor
        return PipelineMonitor(self.config, rank=self.global_rank, group=self.dp_group,
                               device=self.device, stage=grid.stage_id, stages=grid.stages,
                               replica=grid.data_parallel_id)

    def _apply_step(self) -> StepResult:
        result = pipeline_step(self, measure_norm=self.monitor.enabled)
        if self.config.gradient_clipping > 0 or self.precision.name == "fp16":
            return result
        # measured for the monitor alone: get_global_grad_norm() stays None
        self.monitor.note_grad_norm(result.grad_norm)
        return dataclasses.replace(result, grad_norm=None)

    # ------------------------------------------------------------ public API

    @property
    def micro_batches(self) -> int:
        """Micro-batches per ``train_batch``: the accumulation steps in force
        (``set_train_batch_size`` changes them)."""
        return self.config.gradient_accumulation_steps

    def is_first_stage(self) -> bool:
        return self.grid.is_first_stage

    def is_last_stage(self) -> bool:
        return self.grid.is_last_stage

    def set_dataiterator(self, iterator: Iterator[Any]) -> None:
        """The iterator ``train_batch()``/``eval_batch()`` read when given none."""
        self._data_iterator = iterator
        self._iterating_loader = False

    def set_batch_fn(self, fn: Callable[[Any], Any]) -> None:
        """Applied to each item of the data iterator before it is split into
        ``(inputs, labels)``."""
        self._batch_fn = fn

    def reset_activation_shape(self) -> None:
        """DeepSpeed needs this after a shape change; shapes travel with every
        message here, so it does nothing."""

    def _source(self, data_iter: Any) -> Optional[Iterator[Any]]:
        if not self.grid.is_first_stage:
            return None
        if data_iter is not None:
            return iter(data_iter)
        if self._data_iterator is None and self.training_dataloader is not None:
            self._data_iterator = repeat(self.training_dataloader)
            self._iterating_loader = True
        return self._data_iterator

    # ------------------------------------------------------------ checkpoints

    def _checkpoint_layout(self) -> PipelineLayout:
        return PipelineLayout(self)

    def load_checkpoint(self, load_dir: str, tag: Any = None, load_module_strict: bool = True,
                        load_optimizer_states: bool = True,
                        load_lr_scheduler_states: bool = True, load_module_only: bool = False,
                        custom_load_fn: Any = None) -> tuple[Optional[str], Any]:
        """The engine's ``load_checkpoint``; the next ``train_batch()`` reads
        the engine's dataloader from the loaded position."""
        loaded = super().load_checkpoint(load_dir, tag, load_module_strict,
                                         load_optimizer_states, load_lr_scheduler_states,
                                         load_module_only, custom_load_fn)
        if loaded[0] is not None and self._iterating_loader:
            self._data_iterator, self._iterating_loader = None, False
        return loaded

    def save_16bit_model(self, save_dir: str, save_filename: str = "pytorch_model.bin",
                         exclude_frozen_parameters: bool = False) -> bool:
        """The whole model's weights in 16 bits, one file (rank 0 writes it)."""
        return save_16bit_model(self, save_dir, save_filename, exclude_frozen_parameters)

    def train_batch(self, data_iter: Any = None) -> torch.Tensor:
        """One optimizer step over ``gradient_accumulation_steps`` micro-batches;
        returns the mean loss (module docstring) on every rank."""
        if not torch.is_grad_enabled():
            raise DsrunError("engine.train_batch() was called with gradients disabled "
                             "(inside torch.no_grad()?)")
        self.module.train()
        self.monitor.batch_started()
        state = self._new_batch("train", self.micro_batches, self._source(data_iter))
        program = sched.train_schedule(self.num_stages, self.micro_batches, self.stage_id,
                                       labels=self.module.loss_fn is not None)
        self._run(program, state)
        self.monitor.batch_finished()
        assert self.agg_train_loss is not None
        return self.agg_train_loss

    def eval_batch(self, data_iter: Any = None, return_logits: bool = False,
                   compute_loss: bool = True, reduce_output: Optional[str] = "avg",
                   num_micro_batches: Optional[int] = None) -> Any:
        """Forward ``num_micro_batches`` (default gradient_accumulation_steps)
        micro-batches without gradients; returns the mean loss on every rank
        (``reduce_output=None``: the per-micro-batch losses), and with
        ``return_logits`` also the last stage's outputs (a list per
        micro-batch; None on other stages). ``compute_loss=False``: only the
        outputs."""
        if reduce_output not in ("avg", None):
            raise DsrunError(f"eval_batch(reduce_output={reduce_output!r}): use 'avg' or None")
        count = self.micro_batches if num_micro_batches is None else num_micro_batches
        labels = compute_loss and self.module.loss_fn is not None
        was_training = self.module.training
        self.module.eval()
        try:
            state = self._new_batch("eval", count, self._source(data_iter))
            state.keep_outputs = return_logits or not compute_loss
            state.compute_loss = compute_loss
            with torch.no_grad():
                self._run(sched.inference_schedule(self.num_stages, count, self.stage_id,
                                                   labels=labels), state)
                loss = self._aggregate_loss(state, reduce_output) if compute_loss else None
        finally:
            self.module.train(was_training)
        self.agg_eval_loss = loss
        if loss is not None:
            self.monitor.write_eval_loss(loss, self.global_samples)
        outputs = state.results if self.grid.is_last_stage else None
        if not compute_loss:
            return outputs
        return (loss, outputs) if return_logits else loss

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Inference pass of one input through all stages (module docstring)."""
        if len(args) != 1 or kwargs:
            raise DsrunError("engine(inputs) on a pipeline takes exactly one argument (a "
                             "tensor or a tuple of tensors); to train, call "
                             "engine.train_batch(data_iter)")
        source = iter([(args[0], None)]) if self.grid.is_first_stage else None
        state = self._new_batch("eval", 1, source)
        state.keep_outputs, state.compute_loss = True, False
        with torch.no_grad():
            self._run(sched.inference_schedule(self.num_stages, 1, self.stage_id,
                                               labels=False), state)
        return state.results[0] if self.grid.is_last_stage else None

    def backward(self, *args: Any, **kwargs: Any) -> Any:
        raise DsrunError(_TRAIN_ONLY.format(name="backward"))

    def step(self, *args: Any, **kwargs: Any) -> None:
        raise DsrunError(_TRAIN_ONLY.format(name="step"))

    # ------------------------------------------------------------ running

    def _new_batch(self, kind: str, micro_batches: int, source: Any) -> BatchState:
        self._batches += 1
        return BatchState(kind, self._batches, micro_batches, source)

    def _run(self, program: tuple[sched.Instruction, ...], state: BatchState) -> None:
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
        if self._batch_fn is not None:
            item = self._batch_fn(item)
        inputs, labels = split_micro_batch(item, k)
        flatten_payload(inputs, f"the inputs of micro-batch {k}")
        if state.kind == "train":  # tokens/s: counts a (batch, seq) integer first input
            self.monitor.saw_inputs(inputs if isinstance(inputs, (tuple, list)) else (inputs,),
                                    {})
        state.inputs[k] = self.precision.cast_inputs(to_device(inputs, self.device))
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
            for tensor, meta in zip(tensors, header.metas):
                tensor.requires_grad_(meta.requires_grad)
        state.inputs[ins.micro_batch] = tuple(tensors) if header.is_tuple else tensors[0]

    def _forward(self, ins: sched.Forward, state: BatchState) -> None:
        k = ins.micro_batch
        start = time.perf_counter()
        keep = state.kind == "train" and not self.grid.is_first_stage  # until SendGrad
        inputs = state.inputs[k] if keep else state.inputs.pop(k)
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
            state.results.append(outputs)
        if not state.compute_loss:
            return
        loss_fn = self.module.loss_fn
        if loss_fn is not None:
            try:
                loss = loss_fn(outputs, state.labels.pop(k))
            except Exception as exc:
                _annotate(exc, f"(in loss_fn on {self._where(k)})")
                raise
        else:
            loss = outputs
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            what = f"a tensor of shape {list(loss.shape)}" if isinstance(loss, torch.Tensor) \
                else f"a {type(loss).__name__}"
            source = "loss_fn returned" if loss_fn is not None else \
                "without loss_fn, the last layer's output is the loss, and it is"
            raise DsrunError(f"{self._where(k)}: {source} {what}; the loss must be a "
                             "single-element tensor")
        if state.kind == "train":
            state.losses[k] = loss
        state.loss_values.append(loss.detach().float().reshape(()))

    def _send_activation(self, ins: sched.SendActivation, state: BatchState) -> None:
        k = ins.micro_batch
        outputs = state.outputs[k] if state.kind == "train" else state.outputs.pop(k)
        tensors, is_tuple = flatten_payload(outputs, f"the output of {self._where(k)}")
        channel = self.grid.channel("act", self.stage_id, self.stage_id + 1)
        metas = self._send(state.activation_kind, channel, k, state.batch, tensors, is_tuple)
        state.sent[k] = [m for m in metas if m.requires_grad]

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
                 for t in tensors if t.requires_grad]
        channel = self.grid.channel("grad", self.stage_id, self.stage_id - 1)
        self._send("gradient", channel, k, state.batch, grads)

    def _reduce_grads(self, ins: sched.ReduceGrads, state: BatchState) -> None:
        if self._grad_sync is not None:
            with self.monitor.comm_wait("reduce"):
                self._grad_sync.finish()

    def _reduce_tied_grads(self, ins: sched.ReduceTiedGrads, state: BatchState) -> None:
        self.module.tied_weights.reduce_grads()

    # ------------------------------------------------------------ the step

    def _aggregate_loss(self, state: BatchState, reduce_output: Optional[str] = "avg"
                        ) -> Any:
        """The mean loss over micro-batches and replicas, on every rank
        (``reduce_output=None``: per micro-batch, averaged over replicas)."""
        count = state.micro_batches
        if self.grid.is_last_stage:
            values = torch.stack(state.loss_values).to(self.device)
            if len(values) != count:
                raise DsrunError(f"{self._where(count - 1)}: {len(values)} losses for "
                                 f"{count} micro-batches")
        else:
            values = torch.zeros(count, dtype=torch.float32, device=self.device)
        if self.grid.is_last_stage and self.dp_world_size > 1:
            collectives.all_reduce(values, group=self.dp_group)
            values /= self.dp_world_size
        if self.num_stages > 1:
            collectives.broadcast(values, src=self.grid.stage_to_global(self.num_stages - 1),
                           group=self.grid.pipe_group)
        return values.mean() if reduce_output == "avg" else list(values.unbind())

    def _optimizer_step(self, ins: sched.OptimizerStep, state: BatchState) -> None:
        with self.monitor.optimizer_step(self):  # the step's events, the breakdown
            self.agg_train_loss = self._aggregate_loss(state)
            self.progress.record_loss(self.agg_train_loss)
            self.monitor.record_loss(self.agg_train_loss)
            with self._profiling("step"):
                self._take_model_step(None)
        self.micro_steps += state.micro_batches
