"""``PipelineEngine``: trains a :class:`~.module.PipelineModule` batch by batch.

``dsrun.initialize(model=pipeline_module, config=...)`` builds it. Then::

    loss = engine.train_batch(data_iter)   # gradient_accumulation_steps micro-batches
    loss = engine.eval_batch(data_iter)    # the same number, forward only
    out = engine(inputs)                   # one forward through all stages

``train_batch`` runs this stage's 1F1B schedule (:mod:`~.schedule`) one
instruction at a time - data, sends and receives (:mod:`~.p2p`), passes,
the data-parallel and tied-gradient reductions and the optimizer step, by
the handlers of :mod:`~.executor` - and
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

DeepSpeed's engine attributes read by Megatron-DeepSpeed-style code hold
dsrun's true values: ``total_loss`` (the last stage's sum of the batch's
micro-batch losses), ``num_pipe_buffers`` (the most micro-batches this
stage has held at once), ``batch_fn``, ``has_attention_mask`` /
``has_bool_tensors`` (stored declarations: any dtype crosses stages),
``is_pipe_partitioned`` / ``is_grad_partitioned`` (False: no tensor
parallelism), ``pipeline_enable_backward_allreduce`` (True; False is
refused, not ignored) and ``agg_additional_losses`` (=
``get_additional_losses()``: the module's hook averaged as the loss, on
every rank; :mod:`~.losses`).

``save_checkpoint`` / ``load_checkpoint`` are the engine's (DeepSpeed's
signatures and guarantees); :mod:`~.checkpoint` tells the checkpoint
package what each stage's ranks hold, so a pipeline checkpoint is keyed by
the one-stage model's names and loads into any number of stages or
replicas. After a load, ``train_batch()`` without a data iterator reads
the engine's dataloader from the loaded position.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections import OrderedDict
from collections.abc import Iterator
from typing import Any, Callable, Optional

import torch
import torch.utils.checkpoint

from dsrun import checkpointing
from dsrun import comm as collectives
from dsrun.errors import DsrunError
from dsrun.runtime.config import DsrunConfig
from dsrun.runtime.dataloader import RepeatingLoader
from dsrun.runtime.dist import compute_device
from dsrun.runtime.engine import DsrunEngine
from dsrun.runtime.pipe import schedule as sched
from dsrun.runtime.pipe.batch import BatchState
from dsrun.runtime.pipe.checkpoint import PipelineLayout, save_16bit_model
from dsrun.runtime.pipe.errors import (
    PipeAssertionError,
    PipelineError,
    PipeNotImplementedError,
    PipeRuntimeError,
    PipeTypeError,
)
from dsrun.runtime.pipe.executor import InstructionExecutor
from dsrun.runtime.pipe.losses import LossAggregator
from dsrun.runtime.pipe.metrics import PipelineMonitor
from dsrun.runtime.pipe.module import PipelineModule
from dsrun.runtime.pipe.p2p import PendingSends
from dsrun.runtime.pipe.step import check_pipeline_zero, check_stages_train, pipeline_step
from dsrun.runtime.precision import StepResult

log = logging.getLogger("dsrun.runtime")

__all__ = ["PipelineEngine", "PipelineError", "is_even"]

_TRAIN_ONLY = ("engine.{name}() is not how a pipeline trains: engine.train_batch(data_iter) "
               "runs forward, backward and the optimizer step of all "
               "gradient_accumulation_steps micro-batches through the stages together")


def is_even(number: int) -> bool:
    """DeepSpeed's helper (its schedules alternate on even and odd stages)."""
    return number % 2 == 0


def _apply_pipeline_config(config: DsrunConfig, module: PipelineModule) -> None:
    """The config's ``pipeline`` section on the module, as DeepSpeed applies it."""
    section = config.pipeline
    if section.use_reentrant and module.activation_checkpoint_func is checkpointing.checkpoint:
        module.activation_checkpoint_func = functools.partial(torch.utils.checkpoint.checkpoint,
                                                              use_reentrant=True)
    if section.activation_checkpoint_interval > 0:
        module.activation_checkpoint_interval = section.activation_checkpoint_interval


class PipelineEngine(InstructionExecutor, DsrunEngine):
    """Pipeline-parallel training engine (module docstring)."""

    is_pipe_parallel = True
    _boundary_now = False  # InstructionExecutor._at_boundary

    def __init__(self, model: PipelineModule, config: DsrunConfig, *, mpu: Any = None,
                 **kwargs: Any) -> None:
        if not isinstance(model, PipelineModule):
            raise PipeAssertionError(f"PipelineEngine needs a PipelineModule, got "
                                     f"{type(model).__name__}")
        if mpu is not None and mpu is not model.grid:
            raise PipeAssertionError("a PipelineModule brings its own topology (num_stages= "
                                     "or topology=): do not pass mpu= to dsrun.initialize()")
        check_pipeline_zero(config, model)
        check_stages_train(model, config, kwargs.get("optimizer"), compute_device(),
                           kwargs.get("model_parameters"))
        _apply_pipeline_config(config, model)
        super().__init__(model, config, mpu=model.grid, **kwargs)
        self.grid = model.grid
        self.stage_id = self.grid.stage_id
        self.num_stages = self.grid.stages
        # DeepSpeed's attributes
        self.prev_stage, self.next_stage = self.stage_id - 1, self.stage_id + 1
        self.is_data_parallel = self.grid.get_data_parallel_world_size() > 1
        self.is_model_parallel = False
        # no tensor parallelism: nothing is partitioned across model-parallel
        # ranks (DeepSpeed: is_model_parallel and the config's pipeline flags)
        self.is_pipe_partitioned = self.is_grad_partitioned = False
        # DeepSpeed's declarations that the stages exchange bool tensors (it
        # converts them); dsrun's messages carry every dtype, so they change nothing
        self.has_bool_tensors = False
        self.has_attention_mask = type(model).__name__ == "GPT2ModelPipe"  # as DeepSpeed
        self.total_loss: Optional[torch.Tensor] = None
        self.num_pipe_buffers = 0
        self._warned_no_grad = False
        self.agg_train_loss: Optional[torch.Tensor] = None
        # DeepSpeed's: the module's additional losses, averaged as the loss (:mod:`~.losses`)
        self.agg_additional_losses: Optional[OrderedDict[str, torch.Tensor]] = None
        self._losses = LossAggregator(self.grid, self.dp_group, self.dp_world_size, self.device)
        self.agg_eval_loss: Optional[torch.Tensor] = None
        self.last_batch_timing: Optional[dict[str, float]] = None
        self._batches = 0
        self._pending = PendingSends()
        self._data_iterator: Optional[Iterator[Any]] = None
        self._iterating_loader = False  # _data_iterator repeats training_dataloader
        self.batch_fn: Optional[Callable[[Any], Any]] = None  # set_batch_fn's
        self._handlers = self._instruction_handlers()
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
        # the step's norm, where DeepSpeed reports it: with clipping, fp16, bf16 or ZeRO
        reported = self.config.gradient_clipping > 0 or self.precision.reports_norm or \
            self.zero_stage > 0
        result = pipeline_step(self, measure_norm=self.monitor.enabled or reported)
        if reported:
            return result
        # measured for the monitor alone: get_global_grad_norm() stays None
        self.monitor.note_grad_norm(result.grad_norm)
        return dataclasses.replace(result, grad_norm=None)

    # ------------------------------------------------------------ public API

    @property
    def micro_batch_size(self) -> int:
        return self.config.train_micro_batch_size_per_gpu

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
        """The iterator ``train_batch()`` reads when given none."""
        self._set_iterator(iterator, "set_dataiterator")

    def _set_iterator(self, iterator: Iterator[Any], call: str) -> None:
        self._check_iterator(iterator, call)
        self._data_iterator = iterator
        self._iterating_loader = False

    def set_batch_fn(self, fn: Callable[[Any], Any]) -> None:
        """Applied to each item of the data iterator before it is split into
        ``(inputs, labels)`` (``engine.batch_fn``)."""
        self.batch_fn = fn

    def set_has_attention_mask(self, value: bool) -> None:
        """DeepSpeed's declaration that the model's inputs carry a bool
        attention mask (it converts bool tensors to send them). Stored as
        ``has_attention_mask``; dsrun's messages already carry bool tensors,
        so it changes nothing."""
        if not isinstance(value, bool):
            raise PipeAssertionError(f"set_has_attention_mask() takes a bool, got "
                                     f"{type(value).__name__}")
        self.has_attention_mask = value

    def is_gradient_accumulation_boundary(self) -> bool:
        """True only while ``train_batch()`` reduces the batch's gradients
        or steps the optimizer (DeepSpeed's pipeline answer: between calls
        it is False, whatever ``set_gradient_accumulation_boundary`` said)."""
        return self._boundary_now

    def get_additional_losses(self) -> Optional[OrderedDict[str, torch.Tensor]]:
        """The module's ``get_additional_losses()`` of the last training
        batch, averaged over its micro-batches and the data-parallel
        replicas (float32 scalars, the same on every rank; ``None`` if the
        hook returned ``None``), as DeepSpeed's ``agg_additional_losses``."""
        return self.agg_additional_losses

    def get_pipeline_parallel_rank(self) -> int:
        """This rank's pipeline stage."""
        return self.stage_id

    @property
    def pipeline_enable_backward_allreduce(self) -> bool:
        """Whether the schedule averages gradients over the data-parallel
        group (DeepSpeed's switch): always in dsrun."""
        return True

    @pipeline_enable_backward_allreduce.setter
    def pipeline_enable_backward_allreduce(self, value: bool) -> None:
        if not value:
            raise DsrunError("engine.pipeline_enable_backward_allreduce = False is not "
                             "implemented in dsrun: train_batch() always averages gradients "
                             "over the data-parallel group before the optimizer step")

    def reset_activation_shape(self) -> None:
        """DeepSpeed needs this after a shape change; shapes travel with every
        message here, so it does nothing."""

    def _train_source(self) -> Optional[Iterator[Any]]:
        if not self.grid.is_first_stage:
            return None
        if self._data_iterator is None and self.training_dataloader is not None:
            self._data_iterator = RepeatingLoader(self.training_dataloader)
            self._iterating_loader = True
        return self._data_iterator

    @staticmethod
    def _check_iterator(data_iter: Any, call: str) -> None:
        if not hasattr(data_iter, "__next__"):
            kind = type(data_iter).__name__
            raise PipeTypeError(
                f"engine.{call}(data_iter=...) takes an iterator, got a {kind}: pass "
                f"iter(...) of it, or RepeatingLoader(...) (deepspeed.utils) to read it epoch "
                f"after epoch (a {kind} would start again from its first batch at every call)")

    @property
    def data_iterator(self) -> Optional[Iterator[Any]]:
        """The iterator ``train_batch()`` reads next (DeepSpeed's attribute)."""
        return self._data_iterator

    def set_dataloader(self, loader: Any) -> None:
        """Train on ``loader`` from now on, repeating it epoch after epoch."""
        self.set_dataiterator(RepeatingLoader(loader))

    # ------------------------------------------------------------ checkpoints

    def _checkpoint_layout(self) -> PipelineLayout:
        return PipelineLayout(self)

    def load_checkpoint(self, load_dir: str, tag: Any = None, load_module_strict: bool = True,
                        load_optimizer_states: bool = True,
                        load_lr_scheduler_states: bool = True, load_module_only: bool = False,
                        custom_load_fn: Any = None) -> tuple[Optional[str], Any]:
        """The engine's ``load_checkpoint``; the next ``train_batch()`` reads
        the engine's dataloader from the loaded position. ``micro_steps``
        stays 0."""
        loaded = super().load_checkpoint(load_dir, tag, load_module_strict,
                                         load_optimizer_states, load_lr_scheduler_states,
                                         load_module_only, custom_load_fn)
        # a plain engine's checkpoint holds its micro-steps; a pipeline
        # engine's stay 0 (DeepSpeed's load does not restore them)
        self.micro_steps = 0
        self.start_accumulation_round()
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
            raise PipeRuntimeError("engine.train_batch() was called with gradients disabled "
                                   "(inside torch.no_grad()?); use eval_batch() to evaluate")
        if data_iter is not None:  # as DeepSpeed: later calls without one go on reading it
            self._set_iterator(data_iter, "train_batch")
        self.module.train()
        self.total_loss = None
        self.monitor.batch_started()
        self.tput_timer.start()  # one interval per batch, as DeepSpeed's pipeline counts steps
        state = self._new_batch("train", self.micro_batches, self._train_source())
        program = sched.train_schedule(self.num_stages, self.micro_batches, self.stage_id,
                                       labels=self.module.loss_fn is not None)
        self._run(program, state)
        self.tput_timer.stop(global_step=True, report_speed=False)
        self.monitor.batch_finished()
        assert self.agg_train_loss is not None
        return self.agg_train_loss

    def eval_batch(self, data_iter: Any, return_logits: bool = False,
                   compute_loss: bool = True, reduce_output: Optional[str] = "avg",
                   bcast_loss: bool = True, num_micro_batches: Optional[int] = None) -> Any:
        """Forward ``num_micro_batches`` (default gradient_accumulation_steps)
        micro-batches of ``data_iter`` without gradients, as DeepSpeed's:

        * each micro-batch gives ``loss_fn(output, labels)``, or the output
          itself with ``compute_loss=False`` or no ``loss_fn``;
        * ``reduce_output="avg"`` (any case): their mean, averaged over the
          data-parallel replicas; ``None``: the list of them (this replica's);
        * with ``compute_loss`` and ``bcast_loss`` every rank gets the result
          (a float32 scalar, or a list of them), else the last stage alone
          (``None`` elsewhere);
        * ``return_logits``: ``(result, the last micro-batch's output)`` (the
          output on the last stage, ``None`` elsewhere).

        ``data_iter`` is read for this call only; ``train_batch()`` goes on
        with its own iterator. The module is left in eval mode, as
        DeepSpeed's (``train_batch()`` puts it back in train mode); the
        engine's counters do not move."""
        if isinstance(reduce_output, str) and reduce_output.lower() == "avg":
            reduce_output = "avg"  # any case, as DeepSpeed compares
        elif reduce_output is not None:
            raise PipeNotImplementedError(f"eval_batch(reduce_output={reduce_output!r}): use "
                                          "'avg' or None")
        if data_iter is None:
            raise PipeTypeError("engine.eval_batch(data_iter) needs the data to evaluate: an "
                                "iterator of (inputs, labels) micro-batches")
        self._check_iterator(data_iter, "eval_batch")
        count = self.micro_batches if num_micro_batches is None else num_micro_batches
        labels = compute_loss and self.module.loss_fn is not None
        self.module.eval()  # and left so, as DeepSpeed: train_batch() calls train()
        state = self._new_batch("eval", count, data_iter if self.grid.is_first_stage else None)
        state.keep_outputs = return_logits
        state.compute_loss = compute_loss
        with torch.no_grad():
            self._run(sched.inference_schedule(self.num_stages, count, self.stage_id,
                                               labels=labels), state)
            result = self._reduce_eval(state, reduce_output)
            self.agg_eval_loss = result if compute_loss else None
            if compute_loss and (bcast_loss or self.monitor.enabled):
                shared = self._broadcast_eval(result, reduce_output, count)
                result = shared if bcast_loss or self.grid.is_last_stage else None
                self.agg_eval_loss = shared
                self.monitor.write_eval_loss(shared, self.global_samples)
        if return_logits:
            return result, state.results[-1] if self.grid.is_last_stage else None
        return result

    def _reduce_eval(self, state: BatchState, reduce_output: Optional[str]) -> Any:
        """The last stage's per-micro-batch values, reduced (eval_batch);
        None on other stages."""
        if not self.grid.is_last_stage:
            return None
        values = state.loss_values
        if reduce_output is None:
            return list(values)
        first = values[0]
        parts = list(first) if isinstance(first, (tuple, list)) else [first]
        sums = []
        for i, part in enumerate(parts):
            total = part.detach().clone()
            for k, value in enumerate(values[1:], start=1):
                item = value[i] if isinstance(value, (tuple, list)) else value
                if item.shape != total.shape:
                    raise PipeRuntimeError(
                        f"eval_batch(reduce_output='avg'): micro-batch {k} gave shape "
                        f"{list(item.shape)}, micro-batch 0 {list(total.shape)}: outputs of "
                        "different shapes cannot be averaged (use reduce_output=None)")
                total = total + item
            total = total / len(values)
            if self.dp_world_size > 1:
                collectives.all_reduce(total, group=self.dp_group)
                total /= self.dp_world_size
            sums.append(total)
        return type(first)(sums) if isinstance(first, (tuple, list)) else sums[0]

    def _broadcast_eval(self, result: Any, reduce_output: Optional[str], count: int) -> Any:
        """The last stage's eval result on every stage of the pipeline: a
        float32 scalar (``"avg"``) or one per micro-batch (``None``); every
        rank raises the same error if it is not made of single-element
        tensors."""
        size = 1 if reduce_output == "avg" else count
        payload = torch.zeros(1 + size, dtype=torch.float32, device=self.device)
        if self.grid.is_last_stage:
            items = [result] if reduce_output == "avg" else list(result)
            if all(isinstance(t, torch.Tensor) and t.numel() == 1 for t in items):
                payload[0] = 1
                payload[1:] = torch.stack([t.detach().float().reshape(()) for t in items])
        if self.num_stages > 1:
            collectives.broadcast(payload, src=self.grid.stage_to_global(self.num_stages - 1),
                                  group=self.grid.pipe_group)
        if not payload[0]:
            raise DsrunError("eval_batch(): the loss of each micro-batch must be a "
                             "single-element tensor to be sent to every stage; pass "
                             "bcast_loss=False to get the result on the last stage only "
                             "(or compute_loss=False for the outputs)")
        return payload[1] if reduce_output == "avg" else list(payload[1:].unbind())

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
        return state.results[-1] if self.grid.is_last_stage else None

    def backward(self, *args: Any, **kwargs: Any) -> Any:
        raise PipelineError(_TRAIN_ONLY.format(name="backward"))

    def step(self, *args: Any, **kwargs: Any) -> None:
        raise PipelineError(_TRAIN_ONLY.format(name="step"))
