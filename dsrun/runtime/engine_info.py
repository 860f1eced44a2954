"""What a DeepSpeed engine answers about itself: the accessors scripts and
trainers (Hugging Face's integration among them) call on
``DeepSpeedEngine``, as a mixin of :class:`~dsrun.runtime.engine.DsrunEngine`.

Everything here reads the resolved config or the engine's live state;
nothing changes training, except :meth:`EngineInfo.empty_partition_cache`,
which releases the full parameters ZeRO stage 3 holds gathered (after a
``generate()`` loop, say), to be gathered again when next used.

``set_train_batch_size`` / ``set_train_micro_batch_size`` change training
and live on the engine (:mod:`dsrun.runtime.batch_size`).
``offload_states`` / ``reload_states`` (DeepSpeed's moving of the training
state off the GPU between phases) are here only to refuse with a
:class:`~dsrun.errors.DsrunError` that says so.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Optional, Union

import torch

from dsrun.errors import DsrunError
from dsrun.runtime.config import OPTIMIZER_NAMES, DsrunConfig
from dsrun.runtime.config_schema import thaw
from dsrun.runtime.engine_groups import GroupInfo
from dsrun.runtime.engine_offload import OffloadAccessors
from dsrun.runtime.engine_zero_info import ZeroInfo
from dsrun.runtime.precision import torch_dtype
from dsrun.runtime.timer_names import (
    BACKWARD_GLOBAL_TIMER,
    BACKWARD_INNER_GLOBAL_TIMER,
    BACKWARD_REDUCE_GLOBAL_TIMER,
    FORWARD_GLOBAL_TIMER,
    STEP_GLOBAL_TIMER,
)

# DeepSpeed's wall-clock timer names -> dsrun's breakdown parts
# (dsrun.runtime.monitor.events.DEEPSPEED_PARTS). DeepSpeed's per-micro-step
# timers (timer_names.MICRO_TIMERS) have no dsrun counterpart: dsrun times
# each phase per optimizer step, over all its micro-steps.
WALL_CLOCK_TIMERS = {FORWARD_GLOBAL_TIMER: "forward", BACKWARD_GLOBAL_TIMER: "backward",
                     BACKWARD_INNER_GLOBAL_TIMER: "backward_inner",
                     BACKWARD_REDUCE_GLOBAL_TIMER: "backward_allreduce",
                     STEP_GLOBAL_TIMER: "step"}

# DeepSpeed's default torch_autocast.lower_precision_safe_modules
# (deepspeed/runtime/torch_autocast.py), whose gradients it reduces in the
# autocast dtype
LOWER_PRECISION_SAFE_MODULES = (torch.nn.Linear, torch.nn.Conv1d, torch.nn.Conv2d,
                                torch.nn.Conv3d)

# DeepSpeed's own optimizer names (deepspeed/runtime/config.py
# DEEPSPEED_OPTIMIZERS) that dsrun builds: DeepSpeed's config lower-cases
# these; torch.optim names keep torch's spelling (which DeepSpeed needs to
# find them in torch.optim).
DEEPSPEED_LOWER_CASE_OPTIMIZERS = frozenset({"adagrad", "adam", "adamw", "lamb", "lion"})


class EngineInfo(GroupInfo, OffloadAccessors, ZeroInfo):
    """DeepSpeed's engine accessors (module docstring; the offload ones in
    :mod:`~dsrun.runtime.engine_offload`, the other ``zero_*`` ones in
    :mod:`~dsrun.runtime.engine_zero_info`, the process-group ones in
    :mod:`~dsrun.runtime.engine_groups`)."""

    config: DsrunConfig
    optimizer: Any
    client_optimizer: Any
    is_pipe_parallel: bool
    precision: Any
    monitor: Any
    zero_stage: int
    dp_group: Any
    dp_world_size: int
    mpu: Any
    _grad_norm: Optional[torch.Tensor]
    _step_applied: bool

    # DeepSpeed's base engine sets it to None and never fills it (its
    # pipeline engine keeps the last batch's loss there).
    losses: Any = None
    # DeepSpeed's attribute: True when the model has MoE layers, which dsrun
    # does not have.
    has_moe_layers = False
    # DeepSpeed's: the sequence-parallel size (Ulysses), 1 without sequence
    # parallelism, which dsrun does not have.
    sequence_parallel_size = 1
    # DeepSpeed's flag for its one warning about a loss it cannot divide by
    # the accumulation steps (a pipeline loss that is not a tensor): True
    # until that warning, and again after train()/eval() (engine_controls).
    # dsrun refuses such losses by name and never warns: the flag is kept
    # for scripts that read or set it, and has no effect.
    warn_unscaled_loss = True

    # ------------------------------------------------------------ training state

    def get_lr(self) -> list[float]:
        if self.optimizer is None:
            return []
        return [float(group["lr"]) for group in self.optimizer.param_groups]

    def get_mom(self) -> list[Any]:
        """Per param group: Adam's ``betas``, else SGD's ``momentum``, else
        0.0 (Adagrad, ...: DeepSpeed's value for a group without the key)."""
        if self.optimizer is None:
            return []
        return [group["betas"] if "betas" in group else group.get("momentum", 0.0)
                for group in self.optimizer.param_groups]

    def get_global_grad_norm(self) -> Union[torch.Tensor, float, None]:
        """Global gradient norm of the last step, before clipping: as in
        DeepSpeed at ZeRO stages and in fp16 and bf16; also for fp32 at stage
        0 with ``gradient_clipping`` (DeepSpeed 0.19.8 returns None there);
        None for fp32 at stage 0 without clipping. Of DeepSpeed's types: a
        0-d float32 tensor at ZeRO stages 1-3 (scripts call ``.item()`` on
        it), a float at stage 0 and for a skipped step's ``inf``."""
        if self._grad_norm is None:
            return None
        if self.zero_stage == 0:
            return float(self._grad_norm)
        norm = torch.as_tensor(self._grad_norm).detach().reshape(()).float()
        # a skipped step's inf is a float in DeepSpeed's ZeRO optimizers too
        return norm if bool(torch.isfinite(norm)) else float(norm)

    def was_step_applied(self) -> bool:
        return self._step_applied

    def loss_scale(self) -> float:
        """DeepSpeed's: the config's static ``fp16.loss_scale`` (0: dynamic).
        The scale in use is ``engine.precision.loss_scale`` (and a ZeRO
        optimizer's ``cur_scale``)."""
        return float(self.config.fp16.loss_scale)

    def get_type(self) -> list[Any]:
        """Per param group: its ``"type"`` entry, 0.0 where it has none (DeepSpeed's)."""
        if self.optimizer is None:
            return []
        return [group.get("type", 0.0) for group in self.optimizer.param_groups]

    @property
    def basic_optimizer(self) -> Optional[torch.optim.Optimizer]:
        """The torch optimizer that steps (DeepSpeed's, which its ZeRO and
        fp16 optimizers wrap): the engine's optimizer at stage 0 (the
        client's, or the config's), at ZeRO stages the one over this rank's
        fp32 master shards (``engine.optimizer.optimizer``, of the client's
        class); None without an optimizer."""
        if self.optimizer is None:
            return None
        if self.zero_stage == 0:
            return self.optimizer
        inner = self.optimizer.optimizer
        return inner if isinstance(inner, torch.optim.Optimizer) else None

    # ------------------------------------------------------------ not supported

    def offload_states(self, include: Any = None, device: Any = "cpu", pin_memory: bool = True,
                       non_blocking: bool = False) -> None:
        """DeepSpeed's: refused (module docstring)."""
        raise DsrunError(
            "engine.offload_states() is not supported by dsrun: it does not move the optimizer "
            "states, gradients and parameters off the GPU between training phases (DeepSpeed's "
            "ZeRO-3 feature for RLHF frameworks). To keep optimizer states in host memory all "
            'the time, set zero_optimization.offload_optimizer {"device": "cpu"}')

    def reload_states(self, non_blocking: bool = False) -> None:
        """DeepSpeed's counterpart of :meth:`offload_states`: refused too."""
        raise DsrunError("engine.reload_states() is not supported by dsrun: nothing is ever "
                         "offloaded by offload_states(), which dsrun does not support either")

    # ------------------------------------------------------------ datasets

    @staticmethod
    def is_map_style_dataset(obj: Any) -> bool:
        """Indexable with a length (DeepSpeed's test: ``__getitem__`` and ``__len__``)."""
        return hasattr(obj, "__getitem__") and hasattr(obj, "__len__")

    @staticmethod
    def is_iterable_style_dataset(obj: Any) -> bool:
        return isinstance(obj, torch.utils.data.IterableDataset)

    # ------------------------------------------------------------ the config

    def train_batch_size(self) -> int:
        return self.config.train_batch_size

    def train_micro_batch_size_per_gpu(self) -> int:
        return self.config.train_micro_batch_size_per_gpu

    def gradient_accumulation_steps(self) -> int:
        return self.config.gradient_accumulation_steps

    def get_batch_info(self) -> tuple[int, int, int]:
        """(train batch size, micro batch size per GPU, accumulation steps)."""
        return (self.config.train_batch_size, self.config.train_micro_batch_size_per_gpu,
                self.config.gradient_accumulation_steps)

    def fp16_enabled(self) -> bool:
        return self.config.fp16.enabled

    def bfloat16_enabled(self) -> bool:
        return self.config.bf16.enabled

    bf16_enabled = bfloat16_enabled

    def fp16_auto_cast(self) -> bool:
        """``fp16.auto_cast``: floating inputs are cast to fp16 before each
        forward (as configured, with or without fp16, as DeepSpeed's)."""
        return self.config.fp16.auto_cast

    # 16-bit masters and optimizer state: refused when on (dsrun's ZeRO keeps
    # fp32 masters and state), so False on every engine that was built.
    def fp16_master_weights_and_gradients(self) -> bool:
        return self.config.fp16.fp16_master_weights_and_grads

    def bf16_master_weights_and_gradients(self) -> bool:
        return self.config.bf16.bf16_master_weights_and_grads

    def bf16_optimizer_states(self) -> bool:
        return self.config.bf16.bf16_optimizer_states

    def amp_enabled(self) -> bool:
        """DeepSpeed's apex ``amp`` section: dsrun does not implement it."""
        return False

    def get_data_types(self) -> tuple[torch.dtype, torch.dtype]:
        """DeepSpeed's (model dtype, gradient accumulation dtype): the dtype
        of the ``fp16``/``bf16`` section (else fp32), and
        ``data_types.grad_accum_dtype`` where set, else the model dtype."""
        model = torch_dtype(self.config.precision)
        accum = self.config.data_types.grad_accum_dtype
        return model, model if accum is None else torch_dtype(accum)

    @property
    def communication_data_type(self) -> torch.dtype:
        """``communication_data_type`` where set, else the model dtype."""
        comm = self.config.communication_data_type
        return torch_dtype(comm or self.config.precision)

    def managed_gradient_accumulation(self) -> bool:
        return self.config.managed_gradient_accumulation

    def log_level(self) -> Optional[str]:
        return self.config.log_level

    def dynamic_loss_scale(self) -> bool:
        """``fp16.loss_scale`` is 0 (DeepSpeed's test; also true without fp16,
        whose default loss_scale is 0)."""
        return self.config.fp16.loss_scale == 0

    def postscale_gradients(self) -> bool:
        """Not ``prescale_gradients``."""
        return not self.config.prescale_gradients

    def gradient_predivide_factor(self) -> float:
        return self.config.gradient_predivide_factor

    def checkpoint_tag_validation_enabled(self) -> bool:
        """True: every save checks that all ranks pass the same tag."""
        return True

    def checkpoint_tag_validation_fail(self) -> bool:
        """True: different tags are always an error in dsrun, whatever
        ``checkpoint.tag_validation`` says (they would not make one checkpoint)."""
        return True

    def load_universal_checkpoint(self) -> bool:
        """``checkpoint.load_universal`` as configured; dsrun's checkpoints
        load at any world size and stage either way."""
        return self.config.checkpoint.load_universal

    def use_node_local_storage(self) -> bool:
        """``checkpoint.use_node_local_storage`` as configured (dsrun's
        ranks always write their own files)."""
        return self.config.checkpoint.use_node_local_storage

    def initial_dynamic_scale(self) -> int:
        """``2 ** fp16.initial_scale_power`` (DeepSpeed's, with or without fp16)."""
        return int(self.config.fp16.initial_dynamic_scale)

    def dynamic_loss_scale_args(self) -> dict[str, Any]:
        """The fp16 section's dynamic-scaling settings under DeepSpeed's
        loss-scaler names (``init_scale``, ``scale_window``,
        ``delayed_shift``, ``consecutive_hysteresis``, ``min_scale``)."""
        fp16 = self.config.fp16
        low = fp16.min_loss_scale
        return {"init_scale": self.initial_dynamic_scale(),
                "scale_window": fp16.loss_scale_window, "delayed_shift": fp16.hysteresis,
                "consecutive_hysteresis": fp16.consecutive_hysteresis,
                # DeepSpeed's is an int; dsrun also takes fractions
                "min_scale": int(low) if float(low).is_integer() else low}

    def torch_autocast_enabled(self) -> bool:
        return self.config.torch_autocast.enabled

    def torch_autocast_dtype(self) -> Optional[torch.dtype]:
        """``torch_autocast.dtype`` as a torch dtype; None where the config
        names none (DeepSpeed's; the autocast then uses torch's default for
        the device)."""
        dtype = self.config.torch_autocast.dtype
        return None if dtype is None else torch_dtype(dtype)

    def torch_autocast_lower_precision_safe_modules(self) -> list[str]:
        """``torch_autocast.lower_precision_safe_modules`` as configured, else
        DeepSpeed's default (torch's Linear and Conv1d-3d, by dotted class
        name). dsrun reduces every gradient in fp32 whatever it says."""
        names = self.config.torch_autocast.lower_precision_safe_modules
        if names is not None:
            return list(names)
        return [f"{cls.__module__}.{cls.__name__}" for cls in LOWER_PRECISION_SAFE_MODULES]

    # DeepSpeed features whose config sections dsrun accepts but does not
    # act on (passthrough): they are never on here (data_efficiency_enabled
    # reports the section's flag, as DeepSpeed's engine does).
    def curriculum_learning_enabled(self) -> bool:
        return False

    def data_efficiency_enabled(self) -> bool:
        """``data_efficiency.enabled``, as DeepSpeed answers; the section is
        still not acted on (its sampling and routing are not implemented)."""
        section = self.config.passthrough.get("data_efficiency")
        return isinstance(section, Mapping) and section.get("enabled") is True

    def random_ltd_enabled(self) -> bool:
        return False

    def autotuning_enabled(self) -> bool:
        return False

    def elasticity_enabled(self) -> bool:
        return False

    def pld_enabled(self) -> bool:
        return False

    def eigenvalue_enabled(self) -> bool:
        return False

    def dump_state(self) -> bool:
        """The config's ``dump_state`` (dsrun logs the resolved config at start then)."""
        return self.config.dump_state

    def gradient_clipping(self) -> float:
        return self.config.gradient_clipping

    def optimizer_name(self) -> Optional[str]:
        """DeepSpeed's: the client optimizer's class name (for a callable,
        the class of the optimizer it built, where DeepSpeed says
        ``"function"``), else the config's ``optimizer.type`` as DeepSpeed's
        config holds it - lower-case for DeepSpeed's own optimizers
        (``"adamw"``, ``"lamb"``, ...), torch's spelling for torch.optim
        ones (``"SGD"``, ``"RMSprop"``) - else None."""
        if self.client_optimizer is not None:
            basic = self.client_optimizer if isinstance(
                self.client_optimizer, torch.optim.Optimizer) else self.basic_optimizer
            return None if basic is None else type(basic).__name__
        if self.config.optimizer is None:
            return None
        kind = self.config.optimizer.type
        return kind if kind in DEEPSPEED_LOWER_CASE_OPTIMIZERS else OPTIMIZER_NAMES[kind]

    def optimizer_params(self) -> Optional[dict[str, Any]]:
        """The config's ``optimizer.params`` (``"auto"`` values resolved), a
        new dict; None without them (DeepSpeed's, also with a client
        optimizer)."""
        section = self.config.optimizer
        return thaw(section.params) if section is not None and section.params else None

    def scheduler_name(self) -> Optional[str]:
        """The config's ``scheduler.type`` (DeepSpeed's or torch's spelling),
        else None (also with a client scheduler, as DeepSpeed)."""
        return None if self.config.scheduler is None else self.config.scheduler.type

    def scheduler_params(self) -> Optional[dict[str, Any]]:
        """The config's ``scheduler.params`` (``"auto"`` values resolved), a
        new dict; None without them."""
        section = self.config.scheduler
        return thaw(section.params) if section is not None and section.params else None

    def steps_per_print(self) -> float:
        """The config's; infinity where it says never (null or Infinity)."""
        every = self.config.steps_per_print
        return float("inf") if every is None else every

    def wall_clock_breakdown(self) -> bool:
        return self.config.wall_clock_breakdown

    def get_wall_clock_timers(self) -> dict[str, float]:
        """With ``wall_clock_breakdown``: DeepSpeed's timer names (``fwd``,
        ``bwd``, ``bwd_inner``, ``bwd_allreduce``, ``step``) to the
        milliseconds each phase took in the last optimizer step, summed
        over its micro-steps; empty before the first step and without
        ``wall_clock_breakdown`` (DeepSpeed's)."""
        if not self.config.wall_clock_breakdown:
            return {}
        last = self.monitor.timers.last_step_ms()
        return {name: last[part] for name, part in WALL_CLOCK_TIMERS.items() if part in last}

    def memory_breakdown(self) -> bool:
        return self.config.memory_breakdown

    def dataloader_drop_last(self) -> bool:
        return self.config.dataloader_drop_last

    def sparse_gradients_enabled(self) -> bool:
        return self.config.sparse_gradients

    # ---------------------------------------------------- flops profiler

    def flops_profiler_enabled(self) -> bool:
        return self.config.flops_profiler.enabled

    def flops_profiler_recompute_fwd_factor(self) -> float:
        return self.config.flops_profiler.recompute_fwd_factor

    def flops_profiler_profile_step(self) -> int:
        return self.config.flops_profiler.profile_step

    def flops_profiler_module_depth(self) -> int:
        return self.config.flops_profiler.module_depth

    def flops_profiler_top_modules(self) -> int:
        return self.config.flops_profiler.top_modules

    def flops_profiler_detailed(self) -> bool:
        return self.config.flops_profiler.detailed

    def flops_profiler_output_file(self) -> Optional[str]:
        return self.config.flops_profiler.output_file

    # ------------------------------------------------------------ stage 3

    def empty_partition_cache(self) -> None:
        """Release every full parameter ZeRO stage 3 holds gathered outside a
        forward or backward (nothing to do at other stages)."""
        release = getattr(self.optimizer, "empty_partition_cache", None)
        if self.zero_stage == 3 and release is not None:
            release()
