"""The training engine (ZeRO stage 0): DeepSpeed's ``DeepSpeedEngine`` API.

A script drives it one micro-batch at a time::

    loss = engine(batch)        # forward (autocast / fp16 input cast as configured)
    engine.backward(loss)       # scaled by 1/accumulation (x loss scale in fp16)
    engine.step()               # acts only at an accumulation boundary

Invariants:

* After construction every data-parallel rank holds rank 0's parameters and
  buffers (broadcast, as DDP does).
* ``backward`` at an accumulation boundary (outside ``no_sync()``, and
  unless the script set ``enable_backward_allreduce = False`` to call
  ``allreduce_gradients()`` itself: :mod:`engine_controls`) leaves every
  rank with the gradient averaged over the data-parallel group, reduced in
  buckets overlapped with backward (:mod:`grad_sync`); other micro-steps
  accumulate locally.
* ``step`` at a boundary: one optimizer step (clipping, fp16 overflow check
  and loss scale in :mod:`precision`), then the LR scheduler steps once -
  unless the step was skipped - then gradients are cleared and
  ``global_steps``/``global_samples`` advance (skipped steps count in
  ``global_steps`` and ``skipped_steps``, as in DeepSpeed).
* Counters advance identically on all ranks: everything they depend on is
  computed from all-reduced gradients.

ZeRO stages 1 and 2 replace the bucketed all-reduce and the optimizer with
a :class:`~dsrun.runtime.zero.sharded.ZeroOptimizer` (partitioned fp32
masters and optimizer state; at stage 2 gradients too), stage 3 with a
:class:`~dsrun.runtime.zero.stage3.ZeroStage3` that also partitions the
parameters and gathers them around each module's forward and backward;
both are built from the same client/config optimizer
(:mod:`dsrun.runtime.zero.stepping`; the engine's set-up is in
:mod:`engine_setup`).
Rank 0 logs one block of model-state bytes (formula vs held) after the
first step, when optimizer state exists. ``engine.monitor``
(:mod:`dsrun.runtime.monitor.training`) times forward/backward/step for
``wall_clock_breakdown`` and writes DeepSpeed's monitor events per
optimizer step; ``engine.tput_timer`` (DeepSpeed's ThroughputTimer,
:mod:`dsrun.utils.timer`) is started by ``forward`` and stopped by
``step``; ``engine.timers`` is an empty timer group for the script.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import logging
import time
from collections.abc import Callable, Iterable
from typing import Any, Optional

import torch
import torch.distributed as dist

from dsrun.errors import DsrunConfigError, DsrunError
from dsrun.profiling.engine_step import make_flops_profiler
from dsrun.runtime import python_gc
from dsrun.runtime.checkpoint import engine_io as checkpoint_io
from dsrun.runtime.config import DsrunConfig
from dsrun.runtime.direct_backward import DirectBackward
from dsrun.runtime.dist import compute_device
from dsrun.runtime.engine_controls import EngineControls
from dsrun.runtime.engine_info import EngineInfo
from dsrun.runtime.engine_setup import EngineSetup, check_prepartitioned, check_zero_stage
from dsrun.runtime.env import DistEnv
from dsrun.runtime.grad_sync import broadcast_tensors
from dsrun.runtime.lr_schedules import scheduler_step_args
from dsrun.runtime.monitor.training import EngineMonitor
from dsrun.runtime.param_links import link_params
from dsrun.runtime.precision import FullPrecision, StepResult, make_precision
from dsrun.runtime.progress import LOGGER_NAME, Progress
from dsrun.runtime.timer_names import *  # noqa: F403 - deepspeed.runtime.engine exports them
from dsrun.runtime.zero.misuse import released_use_error
from dsrun.runtime.zero.stage3_setup import NO_OPTIMIZER
from dsrun.runtime.zero.stepping import (
    memory_lines,
    zero_step,
)
from dsrun.utils.timer import SynchronizedWallClockTimer, ThroughputTimer

log = logging.getLogger("dsrun.runtime.engine")

OVERFLOW_LOG_INTERVAL_S = 60.0


class DsrunEngine(EngineSetup, EngineInfo, EngineControls, torch.nn.Module):
    """Wraps the client model for data-parallel training (module docstring).

    Build it with :func:`dsrun.initialize`; ``optimizer``/``lr_scheduler`` are
    the client's (an instance, or a callable DeepSpeed-style: params ->
    optimizer, optimizer -> scheduler), else built from the config.
    """

    is_pipe_parallel = False  # DeepSpeed's attribute; True on a PipelineEngine
    # DeepSpeed's: the data-parallel size of the last checkpoint loaded
    loaded_checkpoint_dp_world_size: Optional[int] = None
    loaded_checkpoint_mp_world_size: Optional[int] = None

    def __init__(self, model: torch.nn.Module, config: DsrunConfig, *,
                 optimizer: Any = None, lr_scheduler: Any = None,
                 model_parameters: Optional[Iterable[Any]] = None,
                 env: Optional[DistEnv] = None, mpu: Any = None) -> None:
        super().__init__()
        check_zero_stage(config)
        if not dist.is_initialized():
            raise DsrunError("the process group is not initialised: build the engine with "
                             "dsrun.initialize(), or call dsrun.init_distributed() first")
        env = env or DistEnv.detect()
        self.config = config
        if config.log_level is not None:  # DeepSpeed's: the runtime logger's level
            logging.getLogger(LOGGER_NAME).setLevel(config.log_level.upper())
        self._gc_held = config.disable_python_gc
        if self._gc_held:
            python_gc.hold()
        self.local_rank = env.local_rank
        self.client_optimizer = optimizer  # DeepSpeed's: initialize()'s arguments as given
        self.client_lr_scheduler = lr_scheduler
        self.mpu = mpu
        self._backward_allreduce = True  # engine.enable_backward_allreduce
        self.dp_group = mpu.get_data_parallel_group() if mpu is not None else None
        self.dp_world_size = dist.get_world_size(self.dp_group)
        self.global_rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        if config.dp_size != self.dp_world_size:
            raise DsrunConfigError(f"the config was resolved for data-parallel size "
                                   f"{config.dp_size} ({config.dp_size_source}) but the "
                                   f"data-parallel group has {self.dp_world_size} ranks")
        self.device = compute_device()
        from dsrun import comm  # (the comms logger: set before the first collective)

        comm.configure(config)  # each engine's config decides, off too, as in DeepSpeed
        self.module = model.to(self.device)
        self._broadcast_state()
        self.zero_stage = config.zero_optimization.stage
        self._check_offload()
        check_prepartitioned(self.module, config)
        self.precision: FullPrecision = make_precision(config, self.module, self.device,
                                                       masters=self.zero_stage == 0)
        self._input_cast = self.precision.hook_input_cast(self.module)
        self._direct_backward = DirectBackward(
            self.module.parameters, self._backward_start,
            accumulation=lambda: self.config.gradient_accumulation_steps,
            scaled=lambda: self.precision.scaler is not None)
        self.optimizer = self._make_optimizer(optimizer, model_parameters)
        self._grad_sync = self._make_grad_sync() if self.zero_stage == 0 else None
        if self.zero_stage > 0:
            self.optimizer = self._make_zero_optimizer()
            if not self.is_pipe_parallel:  # a script's optimizer.step() takes the whole step
                self.optimizer.engine_step = self._step_from_optimizer
        self.lr_scheduler = self._make_scheduler(lr_scheduler)
        self.publish_step_state()
        self._init_step_state()
        self._init_observers(config)
        self._compiled: Any = None  # engine.compile()
        link_params(self)  # for dsrun.utils.safe_get_full_fp32_param(param) and friends

    # ------------------------------------------------------------ set-up

    def _init_step_state(self) -> None:
        """The counters and the accumulation round's state, at zero."""
        self.training_dataloader: Any = None
        self.global_steps = 0
        self.global_samples = 0
        self.skipped_steps = 0
        self.micro_steps = 0
        self._round_origin = 0  # micro_steps where the current accumulation rounds began
        self._grad_norm: Optional[torch.Tensor] = None
        self._unowned: Optional[list[torch.nn.Parameter]] = None
        self._step_applied = False
        self._inside_no_sync = False
        self._boundary_override: Optional[bool] = None
        self._backwards_since_boundary = 0
        self._overflow_log = (float("-inf"), 0)  # (time of the last line, overflows since)

    def _init_observers(self, config: DsrunConfig) -> None:
        """The progress line, the monitors, DeepSpeed's timers and the flops profiler."""
        self.progress = Progress(config.steps_per_print, config.train_batch_size,
                                 enabled=self.global_rank == 0, memory=config.memory_breakdown)
        self.monitor = self._make_monitor()
        self.timers = SynchronizedWallClockTimer()  # DeepSpeed's, for the script's own timing
        self.tput_timer = ThroughputTimer(config.timers.throughput,
                                          batch_size=config.train_batch_size,
                                          steps_per_output=config.steps_per_print)
        self.flops_profiler, self._step_profiler = make_flops_profiler(self)

    def _broadcast_state(self) -> None:
        """Every data-parallel rank starts from rank 0's parameters and buffers
        (at stage 3 the partitioning broadcasts the parameters itself)."""
        if self.dp_world_size == 1:
            return
        params = [] if self.config.zero_optimization.stage == 3 else [*self.module.parameters()]
        tensors = [*params, *self.module.buffers()]
        broadcast_tensors(tensors, group=self.dp_group)

    def _make_monitor(self) -> EngineMonitor:
        return EngineMonitor(self.config, rank=self.global_rank, group=self.dp_group,
                             device=self.device)

    # --------------------------------------------------------- training

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if not self.tput_timer.started:  # else the engine's dataloader started it
            self.tput_timer.start()  # a micro-step's interval: forward to step (DeepSpeed's)
        with self.monitor.timed("forward"):
            self.monitor.saw_inputs(args, kwargs)
            with self.precision.autocast(), self._profiling("forward", args, kwargs):
                output = self._forward_module()(*args, **kwargs)
            self._direct_backward.watch(output)
            return output

    def backward(self, loss: torch.Tensor, retain_graph: bool = False,
                 scale_wrt_gas: bool = True) -> torch.Tensor:
        """Backward of ``loss`` / accumulation steps (x loss scale); returns ``loss`` /
        accumulation steps, as DeepSpeed does (unless ``scale_wrt_gas`` is False)."""
        with self.monitor.timed("backward"):
            return self._backward(loss, retain_graph, scale_wrt_gas)

    def _backward(self, loss: torch.Tensor, retain_graph: bool, scale_wrt_gas: bool
                  ) -> torch.Tensor:
        self.progress.record_loss(loss)
        self.monitor.record_loss(loss)
        gas = self.config.gradient_accumulation_steps
        accumulated = loss / gas if scale_wrt_gas and gas > 1 else loss
        scaled = self.precision.scale_loss(accumulated)
        finish = self._backward_start()
        try:
            with self._profiling("backward"), self._direct_backward.engine_backward_running():
                scaled.backward(retain_graph=retain_graph)
        except BaseException as err:
            if self._grad_sync is not None:
                self._grad_sync.disarm()
            explained = released_use_error(self.module, err) if self.zero_stage == 3 else None
            if explained is not None:
                raise explained from err
            raise
        finish()
        return accumulated  # as DeepSpeed: divided by the accumulation steps

    def _backward_start(self) -> Callable[[], None]:
        """Before a backward (``engine.backward``'s or one the script started:
        :mod:`direct_backward`): arm the stage-0 all-reduce at a boundary;
        -> the work to do once that backward has finished."""
        if self._partition_only:
            raise DsrunError(f"engine.backward(): {NO_OPTIMIZER}")
        sync = (self._grad_sync is not None and self._backward_allreduce
                and not self._inside_no_sync and self.is_gradient_accumulation_boundary())
        self._adopt_added_params()  # stage 0: what optimizer.add_param_group put in since
        if self._grad_sync is not None and self._grad_sync.armed:
            self._grad_sync.disarm()  # a failed backward the script started left it armed
        if sync:
            self._grad_sync.arm()
        return functools.partial(self._backward_end, sync)

    def _backward_end(self, sync: bool) -> None:
        if sync:
            with self.monitor.comm_wait("reduce"):
                self._grad_sync.finish()
        if self.zero_stage > 0:
            self.optimizer.micro_step_done()
        self._backwards_since_boundary += 1

    def step(self, lr_kwargs: Optional[dict[str, Any]] = None) -> None:
        """Optimizer step at an accumulation boundary; always counts a micro-step."""
        if self._inside_no_sync:
            raise DsrunError("engine.step() inside engine.no_sync(): gradients were not "
                             "all-reduced; leave the no_sync() block before stepping")
        self._step_applied = False
        boundary = self.is_gradient_accumulation_boundary()
        if boundary:
            with self.monitor.optimizer_step(self), self._profiling("step"):
                self._take_model_step(lr_kwargs)
            self._backwards_since_boundary = 0
        # dsrun's progress line reports samples/s: the timer only measures
        self.tput_timer.stop(global_step=boundary, report_speed=False)
        self.micro_steps += 1

    def _take_model_step(self, lr_kwargs: Optional[dict[str, Any]]) -> None:
        if self._partition_only:
            raise DsrunError(f"engine.step(): {NO_OPTIMIZER}")
        if self.optimizer is None:
            raise DsrunConfigError("engine.step() needs an optimizer: add an \"optimizer\" "
                                   "section to the config or pass optimizer= to initialize()")
        # checked before the step, so a refused lr_kwargs leaves everything as it was
        scheduler_call = scheduler_step_args(self.lr_scheduler, lr_kwargs,
                                             self.config.train_batch_size)
        checkpoint_io.before_step(self)  # an async save may still be copying the state
        self.precision.take_written_scale()  # every step path (a pipeline's too) and the log
        scale_before = self.precision.loss_scale
        result = self._apply_step()
        if self.global_steps == 0 and self.global_rank == 0:
            for line in memory_lines(self.module, self.optimizer, self.zero_stage,
                                     self.dp_world_size, self.precision.name,
                                     self.config.gradient_accumulation_steps):
                log.info("%s", line)
        self._grad_norm = result.grad_norm
        self._step_applied = result.applied
        self.publish_step_state(result.overflow)
        # once per applied step, as DeepSpeed; a plateau scheduler only with
        # lr_kwargs (DeepSpeed passes train_batch_size as its metric, which
        # reads as a plateau and cuts the lr every patience + 1 steps)
        if result.applied and scheduler_call is not None:
            self.lr_scheduler.step(*scheduler_call[0], **scheduler_call[1])
        elif not result.applied:
            self.skipped_steps += 1
            if result.overflow:
                self._log_overflow(scale_before)
        self.zero_grad(set_to_none=False)  # ZeRO keeps its partition accumulators
        self.global_steps += 1
        self.global_samples += self.config.train_batch_size
        extra = f"loss_scale={self.precision.loss_scale:g}" if self.precision.scaler is not None \
            else None
        self.progress.step(self.global_steps, self.skipped_steps, self.get_lr(), extra)

    @property
    def _partition_only(self) -> bool:
        """Stage 3 built without an optimizer (:meth:`_make_zero_optimizer`)."""
        return bool(getattr(self.optimizer, "partition_only", False))

    def _apply_step(self) -> StepResult:
        """Clip, check and apply the optimizer step (a pipeline engine takes
        the gradient norm over all its stages here)."""
        if self.zero_stage > 0:
            return zero_step(self.optimizer, self.precision, self.config.gradient_clipping)
        self._adopt_added_params(at_step=True)
        return self.precision.step(self.optimizer, self.config.gradient_clipping)

    def publish_step_state(self, overflow: bool = False) -> None:
        """DeepSpeed's attributes on the optimizer ``initialize()`` returned:
        ``overflow`` (the last step was skipped for a non-finite gradient;
        Accelerate's ``step_was_skipped`` reads it), and at stage 0 under
        fp16/bf16, where that optimizer is the torch one itself,
        ``cur_scale``/``loss_scale`` (DeepSpeed's fp16 wrapper's; ZeRO's
        optimizers compute them)."""
        optimizer = self.optimizer
        if optimizer is None:
            return
        try:
            optimizer.overflow = overflow
            if self.zero_stage == 0 and self.config.precision != "fp32" and \
                    not hasattr(type(optimizer), "cur_scale"):
                self.precision.publish_scale(optimizer)  # a script's write is taken
        except AttributeError:  # a client optimizer class with read-only attributes of these names
            pass

    def _log_overflow(self, scale_before: float) -> None:
        """One line per OVERFLOW_LOG_INTERVAL_S at most, counting the ones in between."""
        last, since = self._overflow_log
        now = time.monotonic()
        if now - last < OVERFLOW_LOG_INTERVAL_S:
            self._overflow_log = (last, since + 1)
            return
        self._overflow_log = (now, 0)
        if self.global_rank != 0:
            return
        # at ZeRO 1-3 the reduced gradients are in the optimizer's partitions
        name = self.precision.first_bad_param() or (
            self.optimizer.first_nonfinite(self.module)
            or "(none in rank 0's gradient partition: another rank holds it)"
            if self.zero_stage > 0 else "(none found)")
        more = f"; {since} more overflow(s) since the last such line" if since else ""
        if self.precision.scaler is None:
            off = "; bf16.check_grad_overflow false steps on" if self.config.bf16.enabled else ""
            log.warning("non-finite gradient norm at step %d (%s): skipping the step (first "
                        "non-finite gradient: %s); %d step(s) skipped so far%s%s",
                        self.global_steps + 1, self.precision.name, name, self.skipped_steps,
                        more, off)
            return
        log.info("fp16 gradient overflow at step %d: skipping it (first non-finite gradient: "
                 "%s); loss scale %g -> %g; %d step(s) skipped so far%s", self.global_steps + 1,
                 name, scale_before, self.precision.loss_scale, self.skipped_steps, more)

    def _profiling(self, phase: str, *args: Any) -> contextlib.AbstractContextManager[None]:
        """The flops profiler's context for ``phase`` (forward, backward or
        step; it acts only at its configured step), else a no-op."""
        if self._step_profiler is None:
            return contextlib.nullcontext()
        return getattr(self._step_profiler, phase)(*args)

    def __getattr__(self, name: str) -> Any:
        """Attributes of the engine, then (public names only) of the wrapped
        module, as DeepSpeed's engine passes them through (``engine.generate``,
        ``engine.config`` of a transformers model)."""
        try:
            return super().__getattr__(name)  # torch.nn.Module: parameters, submodules
        except AttributeError:
            module = self.__dict__.get("_modules", {}).get("module")
            if module is None or name.startswith("_"):
                raise
            try:
                return getattr(module, name)
            except AttributeError:
                raise AttributeError(f"'{type(self).__name__}' object has no attribute "
                                     f"{name!r}, nor has its module "
                                     f"({type(module).__name__})") from None

    def zero_grad(self, set_to_none: bool = True) -> None:  # type: ignore[override]
        """Clear gradients (model and fp16 master weights). At stage 0 model
        gradients are always released; a ZeRO optimizer owns them (they may
        be views of its flat gradient buffers): ``set_to_none=False`` keeps
        its buffers allocated and zeroed, True releases them."""
        if self.zero_stage > 0 and self.optimizer is not None:
            self.optimizer.zero_grad(set_to_none=set_to_none)
            if self._unowned is None:  # module parameters the optimizer does not train
                owned = {id(p) for p in self.optimizer.trainable_params()}
                self._unowned = [p for p in self.module.parameters() if id(p) not in owned]
            for param in self._unowned:
                param.grad = None
            return
        self.precision.zero_grad()
        for param in self.module.parameters():
            param.grad = None
        if self.optimizer is not None:
            self.optimizer.zero_grad(set_to_none=set_to_none if self.zero_stage else True)

    # ------------------------------------------------------- checkpoints

    def save_checkpoint(self, save_dir: str, tag: Any = None, client_state: Any = None,
                        save_latest: bool = True, exclude_frozen_parameters: bool = False) -> bool:
        """Save everything needed to resume, loadable at any world size and
        ZeRO stage (:mod:`dsrun.runtime.checkpoint`); tag ``global_step{N}``
        by default. Every rank must call it with the same tag."""
        return checkpoint_io.save(self, save_dir, tag, client_state, save_latest,
                                  exclude_frozen_parameters)

    def load_checkpoint(self, load_dir: str, tag: Any = None, load_module_strict: bool = True,
                        load_optimizer_states: bool = True,
                        load_lr_scheduler_states: bool = True, load_module_only: bool = False,
                        custom_load_fn: Any = None) -> tuple[Optional[str], Any]:
        """Resume from a checkpoint -> ``(its directory, client_state)``;
        ``(None, None)`` when ``load_dir`` has no ``latest`` and no tag is given."""
        loaded = checkpoint_io.load(self, load_dir, tag, load_module_strict,
                                    load_optimizer_states, load_lr_scheduler_states,
                                    load_module_only, custom_load_fn)
        self.publish_step_state()  # the loaded loss scale
        return loaded

    def wait_for_checkpoint(self) -> None:
        """Block until an asynchronous save (``"checkpoint": {"async": true}``)
        is written and committed; raise its failure."""
        checkpoint_io.wait(self)

    def collect_python_gc(self) -> int:
        """One cyclic garbage collection now (DeepSpeed's, for
        ``disable_python_gc`` runs: call it where a pause does no harm);
        returns the number of objects collected."""
        return gc.collect()

    def destroy(self) -> None:
        """Wait for an asynchronous checkpoint save (raising its failure), close the monitors,
        remove the gradient hooks (dsrun's, a ZeRO optimizer's, stage 3's fetch hooks and
        ``F.linear``): other means can then train the module; again is harmless."""
        try:
            checkpoint_io.wait(self)
        finally:
            self._direct_backward.remove()  # its hooks stay on the parameters otherwise
            self.monitor.close()  # its files and writers; a later write is a no-op
            if self.zero_stage > 0 and self.optimizer is not None:
                self.optimizer.close()
            if self._gc_held:
                self._gc_held = False
                python_gc.release()
            if self._grad_sync is not None:
                self._grad_sync.close()
                self._grad_sync = None
            if self._input_cast is not None:
                self._input_cast.remove()
                self._input_cast = None


DeepSpeedEngine = DsrunEngine  # DeepSpeed's name: from deepspeed.runtime.engine import ...
