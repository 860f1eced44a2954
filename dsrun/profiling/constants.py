"""DeepSpeed's ``deepspeed.profiling.constants``: the ``flops_profiler``
config keys and their defaults (the defaults are those of dsrun's
:class:`~dsrun.runtime.config_sections.FlopsProfilerConfig`, which are
DeepSpeed 0.19.8's)."""

from __future__ import annotations

from dataclasses import fields
from typing import Any

from dsrun.runtime.config_monitors import FlopsProfilerConfig

FLOPS_PROFILER_FORMAT = '''
flops profiler should be enabled as:
"session_params": {
  "flops_profiler": {
    "enabled": true,
    "recompute_fwd_factor": 0.0,
    "profile_step": 1,
    "module_depth": -1,
    "top_modules": 3,
    "detailed": true,
    "output_file": null
    }
}
'''


def _default(name: str) -> Any:
    return next(f.default for f in fields(FlopsProfilerConfig) if f.name == name)


FLOPS_PROFILER = "flops_profiler"

FLOPS_PROFILER_ENABLED = "enabled"
FLOPS_PROFILER_ENABLED_DEFAULT = _default(FLOPS_PROFILER_ENABLED)

FLOPS_PROFILER_RECOMPUTE_FWD_FACTOR = "recompute_fwd_factor"
FLOPS_PROFILER_RECOMPUTE_FWD_FACTOR_DEFAULT = _default(FLOPS_PROFILER_RECOMPUTE_FWD_FACTOR)

FLOPS_PROFILER_PROFILE_STEP = "profile_step"
FLOPS_PROFILER_PROFILE_STEP_DEFAULT = _default(FLOPS_PROFILER_PROFILE_STEP)

FLOPS_PROFILER_MODULE_DEPTH = "module_depth"
FLOPS_PROFILER_MODULE_DEPTH_DEFAULT = _default(FLOPS_PROFILER_MODULE_DEPTH)

FLOPS_PROFILER_TOP_MODULES = "top_modules"
FLOPS_PROFILER_TOP_MODULES_DEFAULT = _default(FLOPS_PROFILER_TOP_MODULES)

FLOPS_PROFILER_DETAILED = "detailed"
FLOPS_PROFILER_DETAILED_DEFAULT = _default(FLOPS_PROFILER_DETAILED)

FLOPS_PROFILER_OUTPUT_FILE = "output_file"
FLOPS_PROFILER_OUTPUT_FILE_DEFAULT = _default(FLOPS_PROFILER_OUTPUT_FILE)

__all__ = [name for name in dir() if name.startswith("FLOPS_PROFILER")]
