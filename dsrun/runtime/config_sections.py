"""DeepSpeed's config sections: ZeRO (+ offload), fp16, bf16, data types,
torch autocast, activation checkpointing, pipeline and checkpoint options
(``optimizer`` and ``scheduler`` are in :mod:`config_optim`; the monitors,
the communication logger and the flops profiler in :mod:`config_monitors`).

Each section is a frozen dataclass validated at construction (see
:mod:`config_schema`); ``parse_*`` build the sections whose JSON needs more
than key matching (``"auto"`` values, legacy spellings). Names and defaults
follow DeepSpeed's own config classes. Nothing here imports torch.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from types import MappingProxyType
from typing import Any, Optional

from dsrun.errors import DsrunConfigError
from dsrun.runtime.config_schema import (
    Ctx,
    did_you_mean,
    freeze,
    is_auto,
    json_key,
    log,
    opt,
    parse_section,
    show,
    subsection,
    validate_fields,
)

# ------------------------------------------------------------------- sections


@dataclass(frozen=True)
class OffloadParamConfig:
    """``zero_optimization.offload_param`` (ZeRO-3 parameter offload)."""

    device: str = opt("str", "none", choices=("none", "cpu", "nvme"))
    nvme_path: Optional[str] = opt("str", None)
    buffer_count: int = opt("int", 5, low=0)
    buffer_size: int = opt("int", 100_000_000, low=0)
    max_in_cpu: int = opt("int", 1_000_000_000, low=0)
    pin_memory: bool = opt("bool", True)  # DeepSpeed 0.19.8's default

    def __post_init__(self) -> None:
        validate_fields(self)


@dataclass(frozen=True)
class OffloadOptimizerConfig:
    """``zero_optimization.offload_optimizer`` (optimizer state offload)."""

    device: str = opt("str", "none", choices=("none", "cpu", "nvme"))
    nvme_path: Optional[str] = opt("str", None)
    buffer_count: int = opt("int", 4, low=0)
    pin_memory: bool = opt("bool", True)  # DeepSpeed 0.19.8's default
    pipeline_read: bool = opt("bool", False)
    pipeline_write: bool = opt("bool", False)
    fast_init: bool = opt("bool", False)
    ratio: float = opt("float", 1.0, low=0.0, high=1.0)
    super_offload: bool = opt("bool", False)
    convert_grad_on_cpu: bool = opt("bool", True)
    cpuadam_cores_perc: float = opt("float", 0.8, low=0.0, high=1.0)

    def __post_init__(self) -> None:
        validate_fields(self)


# ZeRO sizes that HF configs set to "auto" (they derive them from the model's
# hidden size, which the config layer does not know): DeepSpeed's defaults.
ZERO_AUTO_KEYS = ("reduce_bucket_size", "allgather_bucket_size", "sub_group_size",
                  "stage3_prefetch_bucket_size", "stage3_param_persistence_threshold",
                  "stage3_model_persistence_threshold", "stage3_max_live_parameters",
                  "stage3_max_reuse_distance")


@dataclass(frozen=True)
class ZeroConfig:
    """``zero_optimization``: every key DeepSpeed 0.19.8's DeepSpeedZeroConfig accepts.

    Fields named without the ``stage3_`` prefix accept both spellings, as
    DeepSpeed does. Legacy ``cpu_offload``/``cpu_offload_param`` are folded
    into ``offload_optimizer``/``offload_param`` (device cpu) at construction.
    ``overlap_comm`` defaults to ``stage == 3`` like DeepSpeed.
    """

    stage: int = opt("int", 0, low=0, high=3)
    contiguous_gradients: bool = opt("bool", True)
    reduce_scatter: bool = opt("bool", True)
    # > 0 at every stage, as DeepSpeed's pydantic check (gt=0) and dsrun's ZeRO buckets need
    reduce_bucket_size: int = opt("int", 500_000_000, low=1)
    use_multi_rank_bucket_allreduce: bool = opt("bool", True)
    allgather_partitions: bool = opt("bool", True)
    allgather_bucket_size: int = opt("int", 500_000_000, low=0)
    overlap_comm: Optional[bool] = opt("bool", None)
    load_from_fp32_weights: bool = opt("bool", True)
    elastic_checkpoint: bool = opt("bool", False)
    offload_param: Optional[OffloadParamConfig] = subsection(OffloadParamConfig, optional=True)
    offload_optimizer: Optional[OffloadOptimizerConfig] = subsection(OffloadOptimizerConfig,
                                                                   optional=True)
    sub_group_size: int = opt("int", 1_000_000_000, low=0)
    cpu_offload: Optional[bool] = opt("bool", None)
    cpu_offload_param: Optional[bool] = opt("bool", None)
    cpu_offload_use_pin_memory: Optional[bool] = opt("bool", None)
    prefetch_bucket_size: int = opt("int", 50_000_000, low=0, key="stage3_prefetch_bucket_size",
                                     aliases=("prefetch_bucket_size",))
    param_persistence_threshold: int = opt("int", 100_000, low=0,
                                            key="stage3_param_persistence_threshold",
                                            aliases=("param_persistence_threshold",))
    model_persistence_threshold: int = opt("int", sys.maxsize, low=0,
                                            key="stage3_model_persistence_threshold",
                                            aliases=("model_persistence_threshold",))
    max_live_parameters: int = opt("int", 1_000_000_000, low=0, key="stage3_max_live_parameters",
                                    aliases=("max_live_parameters",))
    max_reuse_distance: int = opt("int", 1_000_000_000, low=0, key="stage3_max_reuse_distance",
                                   aliases=("max_reuse_distance",))
    gather_16bit_weights_on_model_save: bool = opt(
        "bool", False, key="stage3_gather_16bit_weights_on_model_save",
        aliases=("gather_16bit_weights_on_model_save", "stage3_gather_fp16_weights_on_model_save"))
    module_granularity_threshold: int = opt("int", 0, key="stage3_module_granularity_threshold",
                                             aliases=("module_granularity_threshold",))
    use_all_reduce_for_fetch_params: bool = opt(
        "bool", False, key="stage3_use_all_reduce_for_fetch_params",
        aliases=("use_all_reduce_for_fetch_params",))
    allgather_sequential: bool = opt("bool", False, key="stage3_allgather_sequential",
                                      aliases=("allgather_sequential",))
    ignore_unused_parameters: bool = opt("bool", True)
    legacy_stage1: bool = opt("bool", False)
    compute_grad_norm: bool = opt("bool", True)  # false: checked in DsrunConfig (DeepSpeed's rules)
    parameter_alignment: bool = opt("bool", False)
    round_robin_gradients: bool = opt("bool", False)
    zero_hpz_partition_size: int = opt("int", 1, low=0)
    zero_quantized_weights: bool = opt("bool", False)
    zero_quantized_nontrainable_weights: bool = opt("bool", False)
    zero_quantized_gradients: bool = opt("bool", False)
    # (MiCS's mics_shard_size/mics_hierarchical_params_gather and LoCo's
    # zeropp_loco_param, removed in DeepSpeed 0.19.8, are refused with its
    # reason before parsing: config_passthrough.REMOVED_ZERO_KEYS)
    memory_efficient_linear: bool = opt("bool", True)
    pipeline_loading_checkpoint: bool = opt("bool", False)
    override_module_apply: bool = opt("bool", True)
    log_trace_cache_warnings: bool = opt("bool", False)
    enable_sanity_checks: bool = opt("bool", False)
    # ZeRO-3 leaf modules (dsrun.utils.z3_leaf_module): {"classes", "names",
    # "name_suffixes"}, each a list of strings or one string; None: DeepSpeed's
    # default classes (its Hugging Face sparse-MoE blocks)
    leaf_module: Optional[Mapping[str, Any]] = opt("mapping", None)
    # DeepSpeed's ZenFlow (selective updates of the important gradient
    # columns): not implemented, so a section is refused by parse_zero
    zenflow: Optional[Mapping[str, Any]] = opt("mapping", None)
    # where DeepSpeed keeps Muon's momentum at save time; Muon is refused by name
    save_muon_momentum_buffer_in_memory: bool = opt("bool", False)

    def __post_init__(self) -> None:
        validate_fields(self)
        if self.overlap_comm is None:
            object.__setattr__(self, "overlap_comm", self.stage == 3)
        if self.cpu_offload and self.offload_optimizer is None:
            pin = bool(self.cpu_offload_use_pin_memory)
            object.__setattr__(self, "offload_optimizer",
                               OffloadOptimizerConfig(device="cpu", pin_memory=pin))
        if self.cpu_offload_param and self.offload_param is None:
            pin = bool(self.cpu_offload_use_pin_memory)
            object.__setattr__(self, "offload_param",
                               OffloadParamConfig(device="cpu", pin_memory=pin))
        for legacy in ("cpu_offload", "cpu_offload_param", "cpu_offload_use_pin_memory"):
            object.__setattr__(self, legacy, None)
        if self.leaf_module is not None:
            object.__setattr__(self, "leaf_module", _leaf_module(self.leaf_module))
        if self.stage in (1, 2) and self.allgather_bucket_size < 1:
            # DeepSpeed takes 0 (ge=0); dsrun's stage 1/2 gathers in buckets of
            # this many elements, and its ranks refuse 0: said here too, so the
            # launcher's --config check names FILE:LINE
            raise DsrunConfigError(
                f'"zero_optimization.allgather_bucket_size" in the config must be an integer '
                f">= 1 at ZeRO stage {self.stage}, got {self.allgather_bucket_size}")
        ratio = self.offload_optimizer.ratio if self.offload_optimizer else 1.0
        if ratio < 1.0 and self.stage != 3:
            raise DsrunConfigError(f"zero_optimization.offload_optimizer.ratio={ratio:g} (partial "
                                   f"offload) needs ZeRO stage 3, got stage {self.stage}")


def _leaf_module(section: Mapping[str, Any]) -> Mapping[str, Any]:
    """``zero_optimization.leaf_module`` checked: known keys, each a string or
    a list of strings (a string becomes a list of one, as in DeepSpeed)."""
    out = {}
    for key, value in section.items():
        where = f"zero_optimization.leaf_module.{key}"
        keys = ("classes", "names", "name_suffixes")
        if key not in keys:
            raise DsrunConfigError(f"{where} is not a leaf_module key ({', '.join(keys)})"
                                   f"{did_you_mean(key, keys)}")
        items = (value,) if isinstance(value, str) else value
        if not isinstance(items, (list, tuple)) or not all(isinstance(v, str) for v in items):
            raise DsrunConfigError(f"{where} must be a list of strings, got {show(value)}")
        out[key] = tuple(dict.fromkeys(items))
    return freeze(out)


@dataclass(frozen=True)
class FP16Config:
    """``fp16``: mixed precision with loss scaling (``loss_scale`` 0 = dynamic)."""

    enabled: bool = opt("bool", False)
    auto_cast: bool = opt("bool", False)
    loss_scale: float = opt("float", 0.0, low=0.0)
    #: the scale multiplies the loss in fp32: 2**128 is beyond its range
    initial_scale_power: int = opt("int", 16, low=0, high=127)
    loss_scale_window: int = opt("int", 1000, low=1)
    hysteresis: int = opt("int", 2, low=1)
    consecutive_hysteresis: bool = opt("bool", False)
    min_loss_scale: float = opt("float", 1.0, low=0.0)
    fp16_master_weights_and_grads: bool = opt("bool", False)
    fused_mode: bool = opt("bool", True)  # legacy DeepSpeed key, no effect

    def __post_init__(self) -> None:
        validate_fields(self)
        if not (self.enabled and self.dynamic_loss_scale):
            return  # DeepSpeed checks the dynamic keys only where they act
        if self.min_loss_scale <= 0:
            raise DsrunConfigError(
                f"fp16.min_loss_scale={self.min_loss_scale:g} must be > 0 with dynamic loss "
                "scaling (fp16.loss_scale 0): the scale would halve toward 0")
        if self.min_loss_scale > self.initial_dynamic_scale:
            raise DsrunConfigError(
                f"fp16.min_loss_scale={self.min_loss_scale:g} is above the initial loss scale "
                f"2**fp16.initial_scale_power = {self.initial_dynamic_scale:g}: lower "
                "min_loss_scale or raise initial_scale_power")

    @property
    def dynamic_loss_scale(self) -> bool:
        return self.loss_scale == 0.0

    @property
    def initial_dynamic_scale(self) -> float:
        return float(2**self.initial_scale_power)


@dataclass(frozen=True)
class BF16Config:
    """``bf16`` (legacy spelling ``bfloat16``)."""

    enabled: bool = opt("bool", False)
    immediate_grad_update: bool = opt("bool", False)
    #: a non-finite gradient norm skips the step (DeepSpeed's default, true)
    check_grad_overflow: bool = opt("bool", True)
    bf16_master_weights_and_grads: bool = opt("bool", False)
    bf16_optimizer_states: bool = opt("bool", False)

    def __post_init__(self) -> None:
        validate_fields(self)


@dataclass(frozen=True)
class ThroughputConfig:
    """``timers.throughput``: the engine's ``tput_timer`` (DeepSpeed's keys
    and defaults: on, synchronising the device around the timed step)."""

    enabled: bool = opt("bool", True)
    synchronized: bool = opt("bool", True)

    def __post_init__(self) -> None:
        validate_fields(self)


@dataclass(frozen=True)
class TimersConfig:
    """``timers`` (DeepSpeed's): only its ``throughput`` subsection."""

    throughput: ThroughputConfig = subsection(ThroughputConfig)

    def __post_init__(self) -> None:
        validate_fields(self)


# DeepSpeed's DtypeEnum spellings of the floating dtypes -> torch dtype name
DTYPE_NAMES: Mapping[str, str] = MappingProxyType({
    **dict.fromkeys(("fp16", "float16", "half", "torch.float16"), "float16"),
    **dict.fromkeys(("bf16", "bfloat16", "torch.bfloat16"), "bfloat16"),
    **dict.fromkeys(("fp32", "float32", "float", "torch.float32"), "float32")})
# the ones torch.autocast takes
AUTOCAST_DTYPES: Mapping[str, str] = MappingProxyType(
    {name: dtype for name, dtype in DTYPE_NAMES.items() if dtype != "float32"})
# data_types.keep_in_fp32_modules: the model's own Hugging Face lists
KEEP_IN_FP32_AUTO = "auto"


@dataclass(frozen=True)
class DataTypesConfig:
    """``data_types``, DeepSpeed 0.19.8's dtype overrides (names are
    DeepSpeed's DtypeEnum spellings of fp16, bf16 and fp32):

    * ``grad_accum_dtype``: reported by ``engine.get_data_types()``. dsrun
      accumulates gradients in the dtype of the parameters it trains (fp32
      under ``bf16`` and ``torch_autocast``, whose weights stay fp32;
      float16 under ``fp16``, except that ZeRO 2-3 reducing during backward
      sum the reduced micro-steps in fp32 and count a sum beyond float16's
      range as an overflow), so a different one is reported as not acted on.
    * ``param_dtype``: must be the enabled precision's (fp16, bf16, else
      fp32), checked by :class:`~dsrun.runtime.config.DsrunConfig`.
    * ``buffer_dtype``: under fp16 or bf16, the floating buffers are cast to
      it; unset, they keep the dtype the model holds them in.
    * ``keep_in_fp32_modules``: under fp16 or bf16, the buffers kept in (or
      upcast to) fp32: ``"auto"`` (the model's Hugging Face lists), a list
      of name patterns, or ``[]`` (none) - :mod:`dsrun.runtime.buffer_dtypes`.
    """

    grad_accum_dtype: Optional[str] = opt("str", None)
    param_dtype: Optional[str] = opt("str", None)
    buffer_dtype: Optional[str] = opt("str", None)
    keep_in_fp32_modules: Any = opt("any", KEEP_IN_FP32_AUTO)

    def __post_init__(self) -> None:
        validate_fields(self)
        for key in ("grad_accum_dtype", "param_dtype", "buffer_dtype"):
            value = getattr(self, key)
            if value is not None and value not in DTYPE_NAMES:
                raise DsrunConfigError(
                    f'"data_types.{key}" must be one of '
                    + ", ".join(f'"{name}"' for name in DTYPE_NAMES)
                    + f", got {show(value)}{did_you_mean(value, DTYPE_NAMES)}")
        keep = self.keep_in_fp32_modules
        if keep != KEEP_IN_FP32_AUTO and not (
                isinstance(keep, tuple) and all(isinstance(name, str) for name in keep)):
            raise DsrunConfigError('"data_types.keep_in_fp32_modules" must be "auto" or a list '
                                   f"of name patterns, got {show(keep)}"
                                   + (did_you_mean(keep, (KEEP_IN_FP32_AUTO,))
                                      if isinstance(keep, str) else ""))


@dataclass(frozen=True)
class TorchAutocastConfig:
    """``torch_autocast``: fp32 parameters, gradients and optimizer state,
    and the forward under ``torch.autocast(device, dtype)``, as DeepSpeed's
    section. ``dtype`` unset is torch's default for the device (CUDA
    float16, CPU bfloat16); float16 scales the loss dynamically as
    ``torch.amp.GradScaler`` does. ``lower_precision_safe_modules``
    (dotted class names, checked importable) is where DeepSpeed reduces
    gradients in the autocast dtype; dsrun reduces every gradient in fp32,
    so it changes nothing here."""

    enabled: bool = opt("bool", False)
    dtype: Optional[str] = opt("str", None, choices=tuple(AUTOCAST_DTYPES))
    lower_precision_safe_modules: Any = opt("json", None)

    def __post_init__(self) -> None:
        validate_fields(self)
        names = self.lower_precision_safe_modules
        if names is not None and (isinstance(names, str) or not isinstance(names, Sequence)
                                  or not all(isinstance(n, str) and "." in n for n in names)):
            raise DsrunConfigError("torch_autocast.lower_precision_safe_modules must be a list "
                                   'of dotted class names like "torch.nn.Linear", got '
                                   f"{names!r}")

    def torch_dtype(self, device_type: str) -> str:
        """The autocast dtype's torch name on ``device_type``."""
        if self.dtype is None:
            return "float16" if device_type == "cuda" else "bfloat16"
        return AUTOCAST_DTYPES[self.dtype]


@dataclass(frozen=True)
class ActivationCheckpointingConfig:
    """``activation_checkpointing``: what :func:`dsrun.checkpointing.configure`
    reads (``deepspeed_config=``); DeepSpeed's engine does not apply it by
    itself, and neither does dsrun's. ``contiguous_memory_optimization``
    needs ``partition_activations`` and ``number_checkpoints``, as in
    DeepSpeed."""

    partition_activations: bool = opt("bool", False)
    contiguous_memory_optimization: bool = opt("bool", False)
    cpu_checkpointing: bool = opt("bool", False)
    number_checkpoints: Optional[int] = opt("int", None, low=1)
    synchronize_checkpoint_boundary: bool = opt("bool", False)
    profile: bool = opt("bool", False)

    def __post_init__(self) -> None:
        validate_fields(self)
        if self.contiguous_memory_optimization and not self.partition_activations:
            raise DsrunConfigError("activation_checkpointing.contiguous_memory_optimization "
                                   "needs partition_activations: true")
        if self.contiguous_memory_optimization and self.number_checkpoints is None:
            raise DsrunConfigError("activation_checkpointing.contiguous_memory_optimization "
                                   "needs number_checkpoints (the checkpoints per forward)")


@dataclass(frozen=True)
class PipelineConfig:
    """``pipeline``: what a pipeline engine applies to its ``PipelineModule``,
    as DeepSpeed's does: ``activation_checkpoint_interval`` > 0 replaces the
    module's; ``use_reentrant`` false or true picks the non-reentrant or
    torch's reentrant checkpoint for a module that uses the default
    function (unset: dsrun's default, non-reentrant; DeepSpeed's default is
    reentrant - the gradients are the same). ``stages``, ``partition`` and
    ``seed_layers`` are checked but not applied (DeepSpeed does not apply
    them either: they are ``PipelineModule`` arguments); ``pipe_partitioned``
    and ``grad_partitioned`` only matter with tensor parallelism."""

    activation_checkpoint_interval: int = opt("int", 0, low=0)
    use_reentrant: Optional[bool] = opt("bool", None)
    stages: Any = opt("any", "auto")
    partition: Any = opt("any", "best")
    seed_layers: bool = opt("bool", False)
    pipe_partitioned: bool = opt("bool", True)
    grad_partitioned: bool = opt("bool", True)

    def __post_init__(self) -> None:
        validate_fields(self)


@dataclass(frozen=True)
class CheckpointConfig:
    """``checkpoint``: DeepSpeed's keys plus dsrun's ``async`` and ``timeout``.

    ``async`` (dsrun): saves copy the state to host memory and write it in a
    background thread while training goes on; the next save or load, and the
    engine's exit, wait for it and raise its failure. ``timeout`` (dsrun,
    seconds): how long a rank waits for the others to enter a save or load
    before it names the missing ones. ``load_data_position`` (dsrun, default
    true): false makes ``load_checkpoint`` leave the engine's dataloader where
    it is (for scripts that skip to their own position after a load).
    ``fsync`` (dsrun, default true): false
    skips fsync, as ``torch.save`` and DeepSpeed do (a crashed process still
    leaves the previous checkpoint intact; an OS crash may not). DeepSpeed's
    ``tag_validation``
    (``Warn``/``Ignore``/``Fail``), ``load_universal``,
    ``parallel_write``, ``writer`` and ``checkpoint_serialization``
    (torch.save's zipfile format in DeepSpeed; dsrun writes its own files)
    are accepted, ``use_node_local_storage: true`` with a warning (dsrun
    needs a directory every rank shares); dsrun's checkpoints are always
    universal (any world size and stage) and always written by every rank in
    parallel, and different tags on different ranks are always an error,
    since they would not make one checkpoint.
    """

    async_save: bool = opt("bool", False, key="async")
    timeout: float = opt("float", 600.0, low=0.001)
    fsync: bool = opt("bool", True)
    # dsrun's: restore the engine dataloader's position on load (README, Checkpoints)
    load_data_position: bool = opt("bool", True)
    tag_validation: str = opt("str", "Warn", choices=("Warn", "Ignore", "Fail", "WARN",
                                                      "IGNORE", "FAIL", "warn", "ignore", "fail"))
    load_universal: bool = opt("bool", False)
    use_node_local_storage: bool = opt("bool", False)
    parallel_write: Optional[Mapping[str, Any]] = opt("mapping", None)
    writer: Optional[Mapping[str, Any]] = opt("mapping", None)
    checkpoint_serialization: bool = opt("bool", True)

    def __post_init__(self) -> None:
        validate_fields(self)
        if self.use_node_local_storage:
            # DeepSpeed then writes each node's files into its own disk; dsrun's
            # format is one directory every rank shares, so say so now, not at
            # the first save (which fails, naming the hosts that do not share it)
            log.warning('"checkpoint": {"use_node_local_storage": true} is not implemented by '
                        "dsrun: a checkpoint is one directory that every rank writes into and "
                        "reads from, so save_checkpoint/load_checkpoint need a directory on a "
                        "file system every host shares (a save into a node-local one fails "
                        "at its start, naming the hosts); leave the key out")


@dataclass(frozen=True)
class DsrunOptions:
    """``dsrun``: options of our own, reserved so DeepSpeed keys never clash.

    ``allreduce_bucket_size`` (elements, as DeepSpeed counts bucket sizes):
    the ZeRO stage 0 gradient all-reduce bucket; unset, an explicit
    ``zero_optimization.reduce_bucket_size`` is used, else 25 MiB (DDP's).
    ``seq_length``: tokens per sample, for the monitors' tokens/s (without
    it the engine counts the tokens of (batch, seq) integer inputs).
    """

    allow_unknown_keys: bool = opt("bool", False)
    allreduce_bucket_size: Optional[int] = opt("int", None, low=1)
    seq_length: Optional[int] = opt("int", None, low=1)

    def __post_init__(self) -> None:
        validate_fields(self)


def parse_zero(raw: Any, ctx: Ctx) -> ZeroConfig:
    if isinstance(raw, bool):  # DeepSpeed's deprecated "zero_optimization": true
        log.warning('"zero_optimization": %s in %s is deprecated; use {"stage": %d}',
                    show(raw), ctx.source, int(raw))
        return ZeroConfig(stage=int(raw))
    if isinstance(raw, Mapping):
        auto_keys = {key for f in fields(ZeroConfig) if json_key(f) in ZERO_AUTO_KEYS
                     for key in (json_key(f), *f.metadata["aliases"])}
        raw = {k: v for k, v in raw.items() if not (k in auto_keys and is_auto(v))}
    zero = parse_section(ZeroConfig, raw, ("zero_optimization",), ctx)
    if zero.zenflow is not None:
        # DeepSpeed runs its ZenFlow optimizer for any section (it has no
        # "enabled" key): other numbers than plain ZeRO, so never ignored
        raise DsrunConfigError(
            f"{ctx.where(('zero_optimization', 'zenflow'))}: ZenFlow (DeepSpeed's selective "
            "top-k gradient updates with ZeRO-Offload) is not implemented in dsrun, which "
            "would train without it; remove the section (or set it null)")
    return zero

