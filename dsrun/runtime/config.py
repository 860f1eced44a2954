"""DeepSpeed-compatible training config: parse, validate strictly, resolve.

Input is a dict or a path to a JSON file using DeepSpeed's key names.
:func:`resolve` turns it into one frozen :class:`DsrunConfig` in which every
value is concrete: the batch triple is solved, every ``"auto"`` is replaced
and defaults are filled in. Nothing here imports torch.

This module is the public face; the generic checking and key-matching
machinery lives in :mod:`dsrun.runtime.config_schema` and DeepSpeed's
sections (ZeRO, offload, fp16, bf16, optimizer, scheduler, monitors) in
:mod:`dsrun.runtime.config_sections`; reading a raw config and the keys
dsrun accepts without acting on them in :mod:`dsrun.runtime.config_load`.
Their public names are re-exported here, so
``from dsrun.runtime.config import ZeroConfig`` keeps working.

Invariants of a resolved :class:`DsrunConfig`:

* ``train_batch_size == train_micro_batch_size_per_gpu *
  gradient_accumulation_steps * dp_size`` exactly (never floored);
* fp16 and bf16 are not both enabled; ``zero_optimization.stage`` is 0..3
  (the engine decides which stages it implements);
* every section is a frozen dataclass type-checked at construction;
  mappings inside (optimizer/scheduler params) are read-only.

Strictness: an unknown key anywhere (top level or any nested section) is a
:class:`DsrunConfigError` with a did-you-mean suggestion. Escape hatch:
``{"dsrun": {"allow_unknown_keys": true}}`` in the config, or the
environment variable ``DSRUN_ALLOW_UNKNOWN_CONFIG_KEYS=1``, turns each
unknown key into a logged warning; such keys are dropped and listed in
``DsrunConfig.ignored_keys``. A dotted top-level key whose whole path names a
real key (``"zero_optimization.reduce_bucket_size"``, as TRL adds it) is
ignored with one warning, as DeepSpeed ignores it; any other is unknown.
Documented DeepSpeed sections that dsrun does not act on
(``PASSTHROUGH_KEYS``: ``autotuning``, ``data_efficiency``, ...) are accepted,
kept verbatim in ``passthrough`` and reported with one warning when they
are present and not disabled; the sections DeepSpeed 0.19.8 removed
(``elasticity``, ``amp``, ...) are refused (config_passthrough.py).

``"auto"`` (as HF Trainer/Accelerate configs write it) is resolved here:
batch sizes from the data-parallel size and a dataloader batch-size hint;
optimizer ``lr``/``betas``/``eps``/``weight_decay`` from client hints, else
DeepSpeed's default for that optimizer (``AUTO_OPTIMIZER_DEFAULTS``);
scheduler ``warmup_min_lr`` -> 0, ``warmup_max_lr`` -> the optimizer lr,
``warmup_num_steps`` -> hint or 1000 (DeepSpeed's default),
``total_num_steps`` -> hint (required); ``gradient_clipping`` -> 1.0 (as HF);
``fp16/bf16.enabled`` -> false; ZeRO bucket/threshold sizes -> DeepSpeed's
defaults. ``"auto"`` anywhere else is an error naming the key.

Optimizer ``params`` names depend on the installed torch; they are checked
by :mod:`dsrun.runtime.optimizers` when the optimizer is built. Scheduler
``params`` are checked here against DeepSpeed's constructor signatures.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from types import MappingProxyType
from typing import Any, Optional

from dsrun.errors import DsrunConfigError
from dsrun.runtime.config_batch import (  # noqa: F401 - importable from here as before
    BATCH_KEYS,
    resolve_batch,
    resolve_batch_keys,
)
from dsrun.runtime.config_load import (  # noqa: F401 - importable from here as before
    INERT_KEYS,
    PASSTHROUGH_KEYS,
    REPLACED_KEYS,
    _allow_unknown,
    _drop_dotted,
    _passthrough,
    _refuse_replaced,
    _without_auto_enabled,
    inert_settings,
    load_config,
    section_keys,
)
from dsrun.runtime.config_monitors import (
    MONITOR_SECTIONS,
    CometConfig,
    CommsLoggerConfig,
    CsvMonitorConfig,
    FlopsProfilerConfig,
    TensorBoardConfig,
    WandbConfig,
    parse_monitors,
)
from dsrun.runtime.config_optim import (
    AUTO_OPTIMIZER_DEFAULTS,
    DEFAULT_WARMUP_NUM_STEPS,
    OPTIMIZER_NAMES,
    SCHEDULER_PARAMS,
    SCHEDULER_REQUIRED,
    UNSUPPORTED_OPTIMIZERS,
    OptimizerConfig,
    SchedulerConfig,
    canonical_optimizer_type,
    canonical_scheduler_type,
    check_scheduler_params,
    parse_optimizer,
    parse_scheduler,
)
from dsrun.runtime.config_schema import (
    ALLOW_UNKNOWN_ENV,
    AUTO,
    DICT_SOURCE,
    Check,
    ConfigInput,
    Ctx,
    build,
    check_value,
    did_you_mean,
    is_auto,
    json_key,
    log,
    opt,
    parse_section,
    pick,
    show,
    subsection,
    thaw,
    to_dict,
    validate_fields,
)
from dsrun.runtime.config_sections import (
    DTYPE_NAMES,
    KEEP_IN_FP32_AUTO,  # noqa: F401 - importable from here as before
    ZERO_AUTO_KEYS,
    ActivationCheckpointingConfig,
    BF16Config,
    CheckpointConfig,
    DataTypesConfig,
    DsrunOptions,
    FP16Config,
    OffloadOptimizerConfig,
    OffloadParamConfig,
    PipelineConfig,
    TimersConfig,
    TorchAutocastConfig,
    ZeroConfig,
    parse_zero,
)

__all__ = [
    "ALLOW_UNKNOWN_ENV", "AUTO", "AUTO_OPTIMIZER_DEFAULTS", "BATCH_KEYS",
    "DEFAULT_WARMUP_NUM_STEPS", "DTYPE_NAMES", "DICT_SOURCE", "INERT_KEYS", "OPTIMIZER_NAMES",
    "PASSTHROUGH_KEYS",
    "SCHEDULER_PARAMS", "SCHEDULER_REQUIRED", "UNSUPPORTED_OPTIMIZERS", "ZERO_AUTO_KEYS",
    "ActivationCheckpointingConfig", "DataTypesConfig", "BF16Config", "Check", "CheckpointConfig",
    "CometConfig", "CommsLoggerConfig", "ConfigInput", "FlopsProfilerConfig",
    "CsvMonitorConfig", "DsrunConfig",
    "DsrunOptions", "FP16Config", "MONITOR_SECTIONS", "OffloadOptimizerConfig",
    "OffloadParamConfig", "OptimizerConfig", "PipelineConfig", "SchedulerConfig",
    "TensorBoardConfig", "TorchAutocastConfig", "WandbConfig",
    "ZeroConfig", "canonical_optimizer_type", "canonical_scheduler_type", "check_scheduler_params",
    "check_value", "did_you_mean", "inert_settings", "is_auto", "load_config", "resolve",
    "resolve_batch",
]

# ---------------------------------------------------------------- the config

LOG_LEVELS = ("debug", "info", "warning", "error", "critical")  # DeepSpeed's log_level names


def _internal(default: Any) -> Any:
    if isinstance(default, Mapping):
        return field(default_factory=lambda: MappingProxyType({}), metadata={"internal": True})
    return field(default=default, metadata={"internal": True})


@dataclass(frozen=True)
class DsrunConfig:
    """A fully resolved training config (see the module docstring).

    ``dp_size``/``dp_size_source`` record the data-parallel size the batch
    triple was solved for and where it came from; ``source`` is the file
    path or ``"config dict"``.
    """

    train_batch_size: int = opt("int", 1, low=1)
    train_micro_batch_size_per_gpu: int = opt("int", 1, low=1)
    gradient_accumulation_steps: int = opt("int", 1, low=1)
    optimizer: Optional[OptimizerConfig] = subsection(OptimizerConfig, optional=True)
    scheduler: Optional[SchedulerConfig] = subsection(SchedulerConfig, optional=True)
    gradient_clipping: float = opt("float", 1.0, low=0.0)  # DeepSpeed 0.19.8 default
    fp16: FP16Config = subsection(FP16Config)
    bf16: BF16Config = subsection(BF16Config)
    zero_optimization: ZeroConfig = subsection(ZeroConfig)
    checkpoint: CheckpointConfig = subsection(CheckpointConfig)
    # None: never (JSON null, or Infinity, which Accelerate always writes)
    steps_per_print: Optional[int] = opt("int", 10, low=1, optional=True)
    wall_clock_breakdown: bool = opt("bool", False)
    csv_monitor: CsvMonitorConfig = subsection(CsvMonitorConfig)
    tensorboard: TensorBoardConfig = subsection(TensorBoardConfig)
    wandb: WandbConfig = subsection(WandbConfig)
    comet: CometConfig = subsection(CometConfig)
    comms_logger: CommsLoggerConfig = subsection(CommsLoggerConfig)
    flops_profiler: FlopsProfilerConfig = subsection(FlopsProfilerConfig)
    activation_checkpointing: ActivationCheckpointingConfig = subsection(
        ActivationCheckpointingConfig)
    pipeline: PipelineConfig = subsection(PipelineConfig)
    torch_autocast: TorchAutocastConfig = subsection(TorchAutocastConfig)
    timers: TimersConfig = subsection(TimersConfig)
    data_types: DataTypesConfig = subsection(DataTypesConfig)
    memory_breakdown: bool = opt("bool", False)
    dump_state: bool = opt("bool", False)
    communication_data_type: Optional[str] = opt("str", None, choices=("fp16", "bf16", "fp32"))
    seq_parallel_communication_data_type: str = opt("str", "fp32",
                                                    choices=("fp16", "bf16", "fp32"))
    gradient_allreduce_op: str = opt("str", "mean", choices=("mean", "sum"))
    managed_gradient_accumulation: bool = opt("bool", True)
    disable_python_gc: bool = opt("bool", False)
    log_level: Optional[str] = opt("str", None, choices=LOG_LEVELS)
    prescale_gradients: bool = opt("bool", False)
    gradient_predivide_factor: float = opt("float", 1.0, low=0.0)
    sparse_gradients: bool = opt("bool", False)
    disable_allgather: bool = opt("bool", False)
    zero_allow_untested_optimizer: bool = opt("bool", False)
    zero_force_ds_cpu_optimizer: bool = opt("bool", True)
    dataloader_drop_last: bool = opt("bool", False)
    graph_harvesting: bool = opt("bool", False)
    vocabulary_size: Optional[int] = opt("int", None, low=1)
    dsrun: DsrunOptions = subsection(DsrunOptions)
    dp_size: int = _internal(1)
    dp_size_source: str = _internal("data-parallel size 1 (default)")
    source: str = _internal(DICT_SOURCE)
    passthrough: Mapping[str, Any] = _internal(MappingProxyType({}))
    ignored_keys: tuple[str, ...] = _internal(())
    # a "scheduler" section that did not check out, in a config without an
    # "optimizer" resolved for an engine given none (resolve's optimizer_given
    # False): only warned about, since without an optimizer DeepSpeed builds
    # no scheduler (Hugging Face's evaluation-only ZeRO-3 engines keep the
    # section, its step counts filled with 0)
    scheduler_error: Optional[str] = _internal(None)

    def __post_init__(self) -> None:
        validate_fields(self)
        if self.fp16.enabled and self.bf16.enabled:
            raise DsrunConfigError(f"fp16.enabled and bf16.enabled are both true in {self.source}; "
                                   "enable at most one")
        if self.torch_autocast.enabled and self.precision != "fp32":
            raise DsrunConfigError(
                f"torch_autocast.enabled and {self.precision}.enabled are both true in "
                f"{self.source}; enable one ("
                + ("fp16 converts the model to float16; torch_autocast keeps fp32 weights"
                   if self.precision == "fp16" else
                   "dsrun's bf16 already is a bfloat16 autocast over fp32 weights")
                + ")")
        resolve_batch(self.train_batch_size, self.train_micro_batch_size_per_gpu,
                      self.gradient_accumulation_steps, self.dp_size, self.dp_size_source,
                      source=self.source)
        if self.gradient_allreduce_op == "sum":
            raise DsrunConfigError(
                f'gradient_allreduce_op "sum" in {self.source} is not implemented: dsrun always '
                "averages gradients over the data-parallel group; multiply the loss by the "
                'data-parallel size for summed gradients, or use "mean"')
        if not self.managed_gradient_accumulation:
            raise DsrunConfigError(
                f"managed_gradient_accumulation false in {self.source} is not implemented: the "
                "engine reduces gradients at the accumulation boundary of "
                "gradient_accumulation_steps; remove the key or set it true")
        if self.gradient_predivide_factor <= 0:
            raise DsrunConfigError(f"gradient_predivide_factor in {self.source} must be > 0, got "
                                   f"{self.gradient_predivide_factor:g}")
        self._check_param_dtype()
        self._check_zero_flags()
        for section, flag, what in (
                ("fp16", "fp16_master_weights_and_grads", "fp16 master weights and gradients"),
                ("bf16", "bf16_master_weights_and_grads", "bf16 master weights and gradients"),
                ("bf16", "bf16_optimizer_states", "bf16 optimizer states")):
            if getattr(getattr(self, section), flag):
                # DeepSpeed keeps them in 16 bits (with offload_optimizer and
                # DeepSpeedCPUAdam only): other numbers, less memory
                raise DsrunConfigError(
                    f"{section}.{flag} in {self.source}: {what} are not implemented in dsrun, "
                    "whose ZeRO optimizers keep fp32 master weights, gradients and optimizer "
                    "state; remove the key (or set it false)")

    def _check_zero_flags(self) -> None:
        """The ``zero_optimization`` flags DeepSpeed 0.19.8 refuses, refused alike."""
        zero = self.zero_optimization
        if zero.legacy_stage1:
            raise DsrunConfigError(f"zero_optimization.legacy_stage1 in {self.source}: the "
                                   "deprecated ZeRO stage 1 is not supported (DeepSpeed 0.19.8 "
                                   "refuses it too); remove the key or set it false")
        if not zero.compute_grad_norm and zero.stage not in (1, 2):
            raise DsrunConfigError(f"zero_optimization.compute_grad_norm=false in {self.source} "
                                   f"is supported only at ZeRO stage 1 or 2 (stage {zero.stage} "
                                   "here), as in DeepSpeed")
        if not zero.compute_grad_norm and self.gradient_clipping > 0:
            raise DsrunConfigError(f"zero_optimization.compute_grad_norm=false in {self.source} "
                                   f"requires gradient_clipping 0 (it is "
                                   f"{self.gradient_clipping:g}), as in DeepSpeed")

    def _check_param_dtype(self) -> None:
        """``data_types.param_dtype`` is the enabled precision's dtype (DeepSpeed
        asserts it: its optimizers take the dtype from the fp16/bf16 flags)."""
        asked = self.data_types.param_dtype
        trained = {"fp16": "float16", "bf16": "bfloat16"}.get(self.precision, "float32")
        if asked is not None and DTYPE_NAMES[asked] != trained:
            enabled = f"{self.precision}.enabled" if self.precision != "fp32" \
                else "fp32 training (neither fp16 nor bf16 enabled)"
            raise DsrunConfigError(
                f'data_types.param_dtype "{asked}" in {self.source} conflicts with {enabled}, '
                f'whose model dtype is {trained}: set the matching fp16/bf16 "enabled" flag or '
                "remove data_types.param_dtype")

    @property
    def precision(self) -> str:
        """"fp16", "bf16" or "fp32"."""
        return "fp16" if self.fp16.enabled else "bf16" if self.bf16.enabled else "fp32"

    def to_dict(self) -> dict[str, Any]:
        """The resolved config as a DeepSpeed-style dict (JSON-serialisable;
        feeding it back to :func:`resolve` with the same dp size gives an
        equal config)."""
        out = to_dict(self)
        out.update(thaw(self.passthrough))
        return out

    def _loss_scale_note(self) -> str:
        if self.bf16.enabled and not self.fp16.enabled:
            return "" if self.bf16.check_grad_overflow else \
                " (check_grad_overflow false: a non-finite gradient is stepped)"
        if not self.fp16.enabled:
            return ""
        if self.fp16.dynamic_loss_scale:
            return f" (dynamic loss scale, initial 2^{self.fp16.initial_scale_power})"
        return f" (static loss scale {self.fp16.loss_scale:g})"

    def summary(self) -> str:
        """A few human-readable lines for the start-of-run log."""
        zero = self.zero_optimization
        lines = [
            f"config from {self.source}",
            f"batch: train {self.train_batch_size} = micro {self.train_micro_batch_size_per_gpu}"
            f" x accumulation {self.gradient_accumulation_steps} x data-parallel {self.dp_size}"
            f" ({self.dp_size_source})",
            f"precision: {self.precision}{self._loss_scale_note()}"
            + (f", torch_autocast {self.torch_autocast.dtype or 'the device default'}"
               if self.torch_autocast.enabled else ""),
            f"zero: stage {zero.stage}" + (f", offload optimizer to {zero.offload_optimizer.device}"
                                           if zero.offload_optimizer else "")
            + (f", offload params to {zero.offload_param.device}" if zero.offload_param else ""),
            f"gradient clipping: {self.gradient_clipping:g}" if self.gradient_clipping
            else "gradient clipping: off",
        ]
        for name, section in (("optimizer", self.optimizer), ("scheduler", self.scheduler)):
            if section is not None:
                params = ", ".join(f"{k}={show(thaw(v))}" for k, v in section.params.items())
                lines.append(f"{name}: {OPTIMIZER_NAMES.get(section.type, section.type)}({params})")
        monitors = [name for name in MONITOR_SECTIONS if getattr(self, name).enabled]
        if monitors or self.wall_clock_breakdown:
            lines.append("monitors: " + ", ".join(monitors or ["none"])
                         + (", wall_clock_breakdown" if self.wall_clock_breakdown else ""))
        if self.passthrough:
            lines.append("accepted, not acted on: " + ", ".join(sorted(self.passthrough)))
        if self.ignored_keys:
            lines.append("ignored unknown keys: " + ", ".join(self.ignored_keys))
        return "\n".join(lines)


# ------------------------------------------------------------------ resolve


def resolve(config: ConfigInput, *, dp_size: int, dp_source: str,
            micro_batch_hint: Optional[int] = None, total_num_steps: Optional[int] = None,
            warmup_num_steps: Optional[int] = None,
            optimizer_hints: Optional[Mapping[str, Any]] = None,
            environ: Optional[Mapping[str, str]] = None,
            optimizer_given: bool = True) -> DsrunConfig:
    """Parse, validate and resolve ``config`` for ``dp_size`` data-parallel ranks.

    ``dp_source`` says where ``dp_size`` came from (for error messages).
    Hints replace ``"auto"`` values: ``micro_batch_hint`` (the dataloader's
    batch size), ``total_num_steps``/``warmup_num_steps`` (scheduler), and
    ``optimizer_hints`` (client ``lr``/``betas``/``eps``/``weight_decay``).
    ``environ`` defaults to ``os.environ`` (read once, here).
    ``optimizer_given`` False (an engine built without a client optimizer):
    in a config without an ``optimizer`` section, a ``scheduler`` section
    that does not check out is kept as ``scheduler_error`` (warned about
    by the engine, which builds no scheduler) instead of raised.
    """
    raw, source = load_config(config)
    env = os.environ if environ is None else environ
    ctx = Ctx(source, allow_unknown=_allow_unknown(raw, env))
    top = {json_key(f): f for f in fields(DsrunConfig) if not f.metadata.get("internal")}
    valid = {*top, "bfloat16", *PASSTHROUGH_KEYS}
    known = pick(_drop_dotted(_refuse_replaced(raw, ctx), ctx, valid), (), ctx, valid,
                 section_keys(valid))
    for key in ("log_level", "communication_data_type", "seq_parallel_communication_data_type"):
        if isinstance(known.get(key), str):  # DeepSpeed lower-cases them
            known[key] = known[key].lower()
    if "bf16" in known and "bfloat16" in known:
        raise DsrunConfigError(f'both "bf16" and its legacy spelling "bfloat16" are in {source}; '
                               "keep one")
    hints = dict(optimizer_hints or {})
    train, micro, accum = resolve_batch_keys(known, dp_size, dp_source, micro_batch_hint, ctx)
    optimizer = parse_optimizer(known.get("optimizer"), ctx, hints)
    lr = optimizer.params.get("lr", AUTO_OPTIMIZER_DEFAULTS[optimizer.type]["lr"]) \
        if optimizer else hints.get("lr")
    scheduler, scheduler_error = _scheduler(known, ctx, lr, total_num_steps, warmup_num_steps,
                                            optional=optimizer is None and not optimizer_given)
    kwargs: dict[str, Any] = {
        "train_batch_size": train, "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": accum,
        "optimizer": optimizer,
        "scheduler": scheduler, "scheduler_error": scheduler_error,
        **_sections(known, ctx),
    }
    if known.get("steps_per_print") == float("inf"):
        known["steps_per_print"] = None  # Accelerate's way to say never
    if is_auto(known.get("gradient_clipping")):
        known["gradient_clipping"] = 1.0  # what HF's integration fills in
    for key, f in top.items():
        if key in known and f.name not in kwargs and "check" in f.metadata:
            kwargs[f.name] = check_value(known[key], f.metadata["check"], ctx.where((key,)))
    kwargs.update(dp_size=dp_size, dp_size_source=dp_source, source=source,
                  passthrough=_passthrough(known, ctx), ignored_keys=tuple(ctx.ignored))
    resolved = build(DsrunConfig, kwargs, ctx)
    inert = inert_settings(resolved)
    if inert:
        log.warning("%s: dsrun accepts but does not act on: %s", source, "; ".join(inert))
    return resolved


def _scheduler(known: Mapping[str, Any], ctx: Ctx, lr: Any, total_num_steps: Optional[int],
               warmup_num_steps: Optional[int], *, optional: bool
               ) -> tuple[Optional[SchedulerConfig], Optional[str]]:
    """The ``scheduler`` section, or (``optional``: no optimizer will come)
    the error it would raise, for the engine to warn about."""
    try:
        return parse_scheduler(known.get("scheduler"), ctx, lr, total_num_steps,
                               warmup_num_steps), None
    except DsrunConfigError as err:
        if not optional:
            raise
        return None, str(err)


def _sections(known: Mapping[str, Any], ctx: Ctx) -> dict[str, Any]:
    """The sections that need no resolving across keys, parsed."""
    return {
        "fp16": parse_section(FP16Config, _without_auto_enabled(known.get("fp16", {})),
                               ("fp16",), ctx),
        "bf16": parse_section(BF16Config, _without_auto_enabled(
            known.get("bf16", known.get("bfloat16", {}))),
            ("bf16" if "bf16" in known else "bfloat16",), ctx),
        "zero_optimization": parse_zero(known.get("zero_optimization", {}), ctx),
        "checkpoint": parse_section(CheckpointConfig, known.get("checkpoint", {}),
                                    ("checkpoint",), ctx),
        "dsrun": parse_section(DsrunOptions, known.get("dsrun", {}), ("dsrun",), ctx),
        "comms_logger": parse_section(CommsLoggerConfig, known.get("comms_logger", {}),
                                      ("comms_logger",), ctx),
        "flops_profiler": parse_section(FlopsProfilerConfig, known.get("flops_profiler", {}),
                                        ("flops_profiler",), ctx),
        "activation_checkpointing": parse_activation_checkpointing(known, ctx),
        "pipeline": parse_section(PipelineConfig, known.get("pipeline", {}), ("pipeline",), ctx),
        "torch_autocast": parse_section(TorchAutocastConfig, known.get("torch_autocast", {}),
                                        ("torch_autocast",), ctx),
        "timers": parse_section(TimersConfig, known.get("timers", {}), ("timers",), ctx),
        "data_types": parse_section(DataTypesConfig, known.get("data_types", {}),
                                    ("data_types",), ctx),
        **parse_monitors(known, ctx),
    }


def parse_activation_checkpointing(known: Mapping[str, Any], ctx: Ctx
                                   ) -> ActivationCheckpointingConfig:
    """The ``activation_checkpointing`` section of a raw config (defaults
    when absent)."""
    return parse_section(ActivationCheckpointingConfig,
                         known.get("activation_checkpointing", {}),
                         ("activation_checkpointing",), ctx)


def activation_checkpointing_section(config: ConfigInput) -> ActivationCheckpointingConfig:
    """Only the ``activation_checkpointing`` section of a config (dict or
    JSON path), checked strictly, the rest not resolved: what
    :func:`dsrun.checkpointing.configure` reads."""
    raw, source = load_config(config)
    section = raw.get("activation_checkpointing", {})
    return parse_activation_checkpointing({"activation_checkpointing": section},
                                          Ctx(source, allow_unknown=_allow_unknown(raw,
                                                                                   os.environ)))


# DeepSpeed's module path for its config class, which resolves through
# resolve() above (importing this module from inside its __init__)
from dsrun.runtime.ds_config import DeepSpeedConfig  # noqa: E402,F401
