"""DeepSpeed's ``deepspeed.monitor.config``: the monitor sections of a
config. The section classes are dsrun's frozen dataclasses
(:mod:`dsrun.runtime.config_sections`) under DeepSpeed's names; they take
the same keywords (``CSVConfig(enabled=True, output_path="runs")``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from dsrun.errors import DsrunConfigError
from dsrun.runtime.config_monitors import (
    MONITOR_SECTIONS,
    CometConfig,
    CsvMonitorConfig,
    TensorBoardConfig,
    WandbConfig,
)
from dsrun.runtime.config_schema import Ctx, parse_section

__all__ = ["CSVConfig", "CometConfig", "DeepSpeedMonitorConfig", "TensorBoardConfig",
           "WandbConfig", "get_monitor_config"]

CSVConfig = CsvMonitorConfig
SOURCE = "the monitor config"


class DeepSpeedMonitorConfig:
    """The four monitor sections (each a section object, a JSON-style dict,
    or absent for its defaults) and ``enabled``: whether any of them is.
    Unknown keys and bad values are :class:`DsrunConfigError`, as in a
    training config."""

    def __init__(self, tensorboard: Any = None, comet: Any = None, wandb: Any = None,
                 csv_monitor: Any = None, source: str = SOURCE) -> None:
        self.source = source
        given = {"tensorboard": tensorboard, "comet": comet, "wandb": wandb,
                 "csv_monitor": csv_monitor}
        for name, cls in MONITOR_SECTIONS.items():
            setattr(self, name, _section(name, cls, given[name], source))

    @property
    def enabled(self) -> bool:
        return any(getattr(self, name).enabled for name in MONITOR_SECTIONS)


def _section(name: str, cls: type, value: Any, source: str) -> Any:
    if value is None:
        value = {}
    if isinstance(value, cls):
        return value
    if isinstance(value, Mapping):
        return parse_section(cls, value, (name,), Ctx(source))
    raise DsrunConfigError(f'"{name}" in {source} must be a {cls.__name__} or a dict, '
                           f"not {type(value).__name__}")


def get_monitor_config(param_dict: Mapping[str, Any]) -> DeepSpeedMonitorConfig:
    """The monitor sections of a DeepSpeed config dict (others are ignored)."""
    return DeepSpeedMonitorConfig(**{name: param_dict.get(name, {})
                                     for name in MONITOR_SECTIONS})
