"""What a DeepSpeed engine answers about itself: the accessors scripts and
trainers (Hugging Face's integration among them) call on
``DeepSpeedEngine``, as a mixin of :class:`~dsrun.runtime.engine.DsrunEngine`.

Everything here reads the resolved config or the engine's live state;
nothing changes training, except :meth:`EngineInfo.empty_partition_cache`,
which releases the full parameters ZeRO stage 3 holds gathered (after a
``generate()`` loop, say), to be gathered again when next used.

``set_train_batch_size`` / ``set_train_micro_batch_size`` change training
and live on the engine (:mod:`dsrun.runtime.batch_size`).
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist

from dsrun.runtime.config import OPTIMIZER_NAMES, DsrunConfig
from dsrun.runtime.precision import torch_dtype

# DeepSpeed's wall-clock timer names -> dsrun's breakdown parts
# (dsrun.runtime.monitor.events.DEEPSPEED_PARTS). DeepSpeed's per-micro-step
# timers ("fwd_microstep", ...) have no dsrun counterpart: dsrun times
# each phase per optimizer step, over all its micro-steps.
WALL_CLOCK_TIMERS = {"fwd": "forward", "bwd": "backward", "bwd_inner": "backward_inner",
                     "bwd_allreduce": "backward_allreduce", "step": "step"}


class EngineInfo:
    """DeepSpeed's engine accessors (module docstring)."""

    config: DsrunConfig
    optimizer: Any
    precision: Any
    monitor: Any
    zero_stage: int
    dp_group: Any
    mpu: Any
    _grad_norm: Optional[torch.Tensor]
    _step_applied: bool

    # DeepSpeed's base engine sets it to None and never fills it (its
    # pipeline engine keeps the last batch's loss there).
    losses: Any = None

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

    def get_global_grad_norm(self) -> Optional[float]:
        """Global gradient norm of the last step, before clipping: as in
        DeepSpeed, at ZeRO stages, in fp16 and bf16, and with clipping; None
        for fp32 at stage 0 without clipping."""
        return None if self._grad_norm is None else float(self._grad_norm)

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

    # ------------------------------------------------------------ groups

    @property
    def data_parallel_group(self) -> Any:
        """The data-parallel process group: the mpu's, else the world group."""
        return self.dp_group if self.dp_group is not None else dist.group.WORLD

    @property
    def mp_world_size(self) -> int:
        """Model-parallel size: the mpu's, else 1 (DeepSpeed's attribute)."""
        if self.mpu is None:
            return 1
        return int(self.mpu.get_model_parallel_world_size())

    def get_model_parallel_rank(self) -> int:
        """This rank in its model-parallel group: the mpu's, else 0."""
        if self.mpu is None:
            return 0
        return int(self.mpu.get_model_parallel_rank())

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

    def zero_optimization(self) -> bool:
        return self.config.zero_optimization.stage > 0

    def zero_optimization_stage(self) -> int:
        return self.config.zero_optimization.stage

    def zero_offload_optimizer(self) -> bool:
        return self.config.zero_optimization.offload_optimizer is not None

    def zero_offload_param(self) -> bool:
        return self.config.zero_optimization.offload_param is not None

    def zero_cpu_offload(self) -> bool:
        offload = self.config.zero_optimization.offload_optimizer
        return offload is not None and offload.device == "cpu"

    def zero_gather_16bit_weights_on_model_save(self) -> bool:
        """``stage3_gather_16bit_weights_on_model_save`` (DeepSpeed's)."""
        return bool(self.config.zero_optimization.gather_16bit_weights_on_model_save)

    def zero_optimization_partition_gradients(self) -> bool:
        """Gradients partitioned: ZeRO stage 2 or 3."""
        return self.config.zero_optimization.stage >= 2

    def zero_optimization_partition_weights(self) -> bool:
        """Parameters partitioned: ZeRO stage 3."""
        return self.config.zero_optimization.stage >= 3

    is_first_weights_partition_group = zero_optimization_partition_weights

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

    def zero_load_from_fp32_weights(self) -> bool:
        """``zero_optimization.load_from_fp32_weights``: dsrun always loads
        the fp32 masters it saved."""
        return self.config.zero_optimization.load_from_fp32_weights

    # DeepSpeed features whose config sections dsrun accepts but does not
    # act on (passthrough): they are never on here.
    def curriculum_learning_enabled(self) -> bool:
        return False

    def data_efficiency_enabled(self) -> bool:
        return False

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
        """The config's optimizer (DeepSpeed's spelling, e.g. ``"AdamW"``),
        else the client optimizer's class name, else None."""
        if self.config.optimizer is not None:
            return OPTIMIZER_NAMES.get(self.config.optimizer.type, self.config.optimizer.type)
        if self.optimizer is None:
            return None
        inner = getattr(self.optimizer, "optimizer", self.optimizer)
        return type(inner).__name__

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
