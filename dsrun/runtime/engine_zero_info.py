"""DeepSpeed's ``zero_*`` engine accessors, a base of
:class:`~dsrun.runtime.engine_info.EngineInfo` (the offload ones are in
:mod:`~dsrun.runtime.engine_offload`).

Each answers what DeepSpeed 0.19.8's engine answers for the same config:
the ``zero_optimization`` value as configured, DeepSpeed's default
included. Many of those keys tune DeepSpeed's own implementation and are
accepted as no-ops by dsrun (the README's ``zero_optimization`` keys
paragraph names which); the accessor still reports the configured value,
as a script reading it back from DeepSpeed would get. Keys dsrun refuses
when switched on (ZeRO++ quantisation, hpZ) report their off value on
any engine that was built.
"""

from __future__ import annotations

from dsrun.runtime.config import DsrunConfig


class ZeroInfo:
    """The ``zero_*`` accessors (module docstring)."""

    config: DsrunConfig

    # ------------------------------------------------------------ the stage

    def zero_optimization(self) -> bool:
        return self.config.zero_optimization.stage > 0

    def zero_optimization_stage(self) -> int:
        return self.config.zero_optimization.stage

    def zero_optimization_partition_gradients(self) -> bool:
        """Gradients partitioned: ZeRO stage 2 or 3."""
        return self.config.zero_optimization.stage >= 2

    def zero_optimization_partition_weights(self) -> bool:
        """Parameters partitioned: ZeRO stage 3."""
        return self.config.zero_optimization.stage >= 3

    is_first_weights_partition_group = zero_optimization_partition_weights

    def zero_gather_16bit_weights_on_model_save(self) -> bool:
        """``stage3_gather_16bit_weights_on_model_save`` (DeepSpeed's)."""
        return bool(self.config.zero_optimization.gather_16bit_weights_on_model_save)

    def zero_load_from_fp32_weights(self) -> bool:
        """``zero_optimization.load_from_fp32_weights``: dsrun always loads
        the fp32 masters it saved."""
        return self.config.zero_optimization.load_from_fp32_weights

    def zero_allow_untested_optimizer(self) -> bool:
        return self.config.zero_allow_untested_optimizer

    def zero_force_ds_cpu_optimizer(self) -> bool:
        """The top-level ``zero_force_ds_cpu_optimizer`` (default True)."""
        return self.config.zero_force_ds_cpu_optimizer

    # ------------------------------------------------ sizes and switches
    # Where a size is left at DeepSpeed's default, dsrun's ZeRO uses its own
    # smaller buckets (dsrun.runtime.zero.stepping), and overlap_comm is
    # resolved (default: stage 3).

    def zero_reduce_bucket_size(self) -> int:
        return self.config.zero_optimization.reduce_bucket_size

    def zero_allgather_bucket_size(self) -> int:
        return self.config.zero_optimization.allgather_bucket_size

    def zero_overlap_comm(self) -> bool:
        return bool(self.config.zero_optimization.overlap_comm)

    def zero_contiguous_gradients(self) -> bool:
        return self.config.zero_optimization.contiguous_gradients

    def zero_reduce_scatter(self) -> bool:
        """``reduce_scatter`` (default True; false: plain all-reduce)."""
        return self.config.zero_optimization.reduce_scatter

    def zero_allgather_partitions(self) -> bool:
        return self.config.zero_optimization.allgather_partitions

    def zero_ignore_unused_parameters(self) -> bool:
        return self.config.zero_optimization.ignore_unused_parameters

    def zero_round_robin_gradients(self) -> bool:
        return self.config.zero_optimization.round_robin_gradients

    def zero_compute_grad_norm(self) -> bool:
        """As configured; dsrun computes the norm either way (README)."""
        return self.config.zero_optimization.compute_grad_norm

    def zero_parameter_alignment(self) -> bool:
        """As configured; a layout knob dsrun's flat buffers do not need."""
        return self.config.zero_optimization.parameter_alignment

    def zero_multi_rank_bucket_allreduce(self) -> bool:
        """``use_multi_rank_bucket_allreduce`` (DeepSpeed's accessor name)."""
        return self.config.zero_optimization.use_multi_rank_bucket_allreduce

    def zero_elastic_checkpoint(self) -> bool:
        """``elastic_checkpoint``: dsrun's checkpoints load at any world size
        whatever it says."""
        return self.config.zero_optimization.elastic_checkpoint

    def zero_legacy_stage1(self) -> bool:
        return self.config.zero_optimization.legacy_stage1

    def zero_sub_group_size(self) -> int:
        return self.config.zero_optimization.sub_group_size

    # ------------------------------------------------------------ stage 3

    def zero_max_live_parameters(self) -> int:
        return self.config.zero_optimization.max_live_parameters

    def zero_max_reuse_distance(self) -> int:
        return self.config.zero_optimization.max_reuse_distance

    def zero_prefetch_bucket_size(self) -> int:
        return self.config.zero_optimization.prefetch_bucket_size

    def zero_param_persistence_threshold(self) -> int:
        return self.config.zero_optimization.param_persistence_threshold

    def zero_model_persistence_threshold(self) -> int:
        return self.config.zero_optimization.model_persistence_threshold

    def zero_module_granularity_threshold(self) -> int:
        return self.config.zero_optimization.module_granularity_threshold

    def zero_allgather_sequential(self) -> bool:
        return self.config.zero_optimization.allgather_sequential

    def zero_log_trace_cache_warnings(self) -> bool:
        return self.config.zero_optimization.log_trace_cache_warnings

    def is_sanity_checks_enabled(self) -> bool:
        """``zero_optimization.enable_sanity_checks`` (DeepSpeed's name)."""
        return self.config.zero_optimization.enable_sanity_checks

    # --------------------------------------------- ZeRO++ (refused when on)

    def zero_hpz_partition_size(self) -> int:
        return self.config.zero_optimization.zero_hpz_partition_size

    def zero_quantized_weights(self) -> bool:
        return self.config.zero_optimization.zero_quantized_weights

    def zero_quantized_nontrainable_weights(self) -> bool:
        return self.config.zero_optimization.zero_quantized_nontrainable_weights

    def zero_quantized_gradients(self) -> bool:
        return self.config.zero_optimization.zero_quantized_gradients
