"""DeepSpeed's config sections for watching a run: the monitors
(csv_monitor, tensorboard, wandb, comet), the communication logger and the
flops profiler. Frozen dataclasses validated at construction, as in
:mod:`config_sections`. Nothing here imports torch.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Optional

from dsrun.errors import DsrunConfigError
from dsrun.runtime.config_schema import Ctx, opt, parse_section, show, validate_fields

DEFAULT_JOB_NAME = "DeepSpeedJobName"  # DeepSpeed's default, so its paths stay the same


@dataclass(frozen=True)
class _EventFilesConfig:
    """A monitor writing files under ``output_path/job_name`` (``output_path``
    "" is the working directory, as in DeepSpeed)."""

    enabled: bool = opt("bool", False)
    output_path: str = opt("str", "")
    job_name: str = opt("str", DEFAULT_JOB_NAME)

    def __post_init__(self) -> None:
        validate_fields(self)


@dataclass(frozen=True)
class CsvMonitorConfig(_EventFilesConfig):
    """``csv_monitor``: one CSV per event under ``output_path/job_name``."""


@dataclass(frozen=True)
class TensorBoardConfig(_EventFilesConfig):
    """``tensorboard``: event files under ``output_path/job_name`` through
    ``torch.utils.tensorboard`` (needs the ``tensorboard`` package)."""


@dataclass(frozen=True)
class WandbConfig:
    """``wandb``: ``wandb.init(project=, group=, entity=team)`` on rank 0
    (needs the ``wandb`` package; ``WANDB_MODE=offline`` writes locally)."""

    enabled: bool = opt("bool", False)
    group: Optional[str] = opt("str", None)
    team: Optional[str] = opt("str", None)
    project: str = opt("str", "deepspeed")

    def __post_init__(self) -> None:
        validate_fields(self)


@dataclass(frozen=True)
class CommsLoggerConfig:
    """``comms_logger``: DeepSpeed's communication logger
    (:mod:`dsrun.runtime.commlog`; summary by ``dsrun.comm.log_summary()``).
    ``prof_all`` profiles every operation, ``prof_ops`` the named ones
    (log names such as ``"all_reduce"``)."""

    enabled: bool = opt("bool", False)
    verbose: bool = opt("bool", False)
    prof_all: bool = opt("bool", True)
    debug: bool = opt("bool", False)
    prof_ops: tuple[str, ...] = opt("json", ())

    def __post_init__(self) -> None:
        validate_fields(self)
        ops = self.prof_ops
        if not isinstance(ops, (list, tuple)) or not all(isinstance(o, str) for o in ops):
            shown = list(ops) if isinstance(ops, (list, tuple)) else ops
            raise DsrunConfigError(f"comms_logger.prof_ops must be a list of operation names "
                                   f"(strings), got {show(shown)}")
        object.__setattr__(self, "prof_ops", tuple(ops))


@dataclass(frozen=True)
class FlopsProfilerConfig:
    """``flops_profiler``: profile one optimizer step on global rank 0
    (:mod:`dsrun.profiling.flops_profiler`): the step where
    ``engine.global_steps == profile_step``, as in DeepSpeed. dsrun counts
    the backward's flops instead of estimating them, so
    ``recompute_fwd_factor`` is accepted but not needed."""

    enabled: bool = opt("bool", False)
    recompute_fwd_factor: float = opt("float", 0.0, low=0.0)
    profile_step: int = opt("int", 1, low=0)
    module_depth: int = opt("int", -1, low=-1)
    top_modules: int = opt("int", 1, low=1)
    detailed: bool = opt("bool", True)
    output_file: Optional[str] = opt("str", None)

    def __post_init__(self) -> None:
        validate_fields(self)


@dataclass(frozen=True)
class CometConfig:
    """``comet``: a Comet experiment on rank 0 through ``comet_ml.start``
    (needs the ``comet_ml`` package); an event name is logged the first time
    it comes, then once ``samples_log_interval`` samples (``global_samples``)
    have passed since it was last logged, as in DeepSpeed. ``api_key`` is
    never logged (``COMET_API_KEY`` works too)."""

    enabled: bool = opt("bool", False)
    samples_log_interval: int = opt("int", 100, low=1)
    project: Optional[str] = opt("str", None)
    workspace: Optional[str] = opt("str", None)
    api_key: Optional[str] = opt("str", None)
    experiment_name: Optional[str] = opt("str", None)
    experiment_key: Optional[str] = opt("str", None)
    online: Optional[bool] = opt("bool", None)
    mode: Optional[str] = opt("str", None, choices=("get_or_create", "create", "get"))

    def __post_init__(self) -> None:
        validate_fields(self)


MONITOR_SECTIONS: Mapping[str, type] = MappingProxyType({
    "csv_monitor": CsvMonitorConfig, "tensorboard": TensorBoardConfig, "wandb": WandbConfig,
    "comet": CometConfig})


def parse_monitors(known: Mapping[str, Any], ctx: Ctx) -> dict[str, Any]:
    """The monitor sections of a config (absent ones get their defaults)."""
    return {name: parse_section(cls, known.get(name, {}), (name,), ctx)
            for name, cls in MONITOR_SECTIONS.items()}
