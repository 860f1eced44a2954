"""DeepSpeed's ``deepspeed.profiling.config``: :class:`DeepSpeedFlopsProfilerConfig`,
the ``flops_profiler`` section of a config dict as an object with one
attribute per key (and the key constants of :mod:`.constants`, which
DeepSpeed's module re-exports).

The section is checked as the engine checks it (dsrun's
:class:`~dsrun.runtime.config_sections.FlopsProfilerConfig`): an unknown
key or a bad value is a :class:`~dsrun.errors.DsrunConfigError` naming it,
where DeepSpeed takes the section as given.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import fields
from typing import Any

from dsrun.errors import DsrunConfigError
from dsrun.profiling.constants import *  # noqa: F403 - DeepSpeed's module re-exports them
from dsrun.profiling.constants import FLOPS_PROFILER
from dsrun.runtime.config_monitors import FlopsProfilerConfig
from dsrun.runtime.config_schema import Ctx, parse_section

SOURCE = "the flops profiler config"


class DeepSpeedFlopsProfilerConfig:
    """``enabled``, ``recompute_fwd_factor``, ``profile_step``,
    ``module_depth``, ``top_modules``, ``detailed`` and ``output_file`` of
    ``param_dict["flops_profiler"]`` (defaults where the section or a key
    is absent); other keys of ``param_dict`` are not looked at."""

    def __init__(self, param_dict: Mapping[str, Any]) -> None:
        if not isinstance(param_dict, Mapping):
            raise DsrunConfigError("DeepSpeedFlopsProfilerConfig takes a config dict, not "
                                   f"{type(param_dict).__name__}")
        section = parse_section(FlopsProfilerConfig, param_dict.get(FLOPS_PROFILER, {}),
                                (FLOPS_PROFILER,), Ctx(SOURCE))
        for f in fields(section):
            setattr(self, f.name, getattr(section, f.name))

    def repr(self) -> dict[str, Any]:
        """The settings as a dict (DeepSpeed's ``DeepSpeedConfigObject.repr``)."""
        return self.__dict__

    def __repr__(self) -> str:
        return json.dumps(self.__dict__, indent=4)
