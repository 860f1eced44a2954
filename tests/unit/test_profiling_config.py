"""DeepSpeed's ``deepspeed.profiling.config`` and ``deepspeed.profiling.constants``
(dsrun/profiling/config.py, constants.py): the keys and defaults are
DeepSpeed 0.19.8's (printed by its modules in bench/.venv-ds and pasted
here), and the section is checked as the engine checks it."""

from __future__ import annotations

import importlib

import pytest

import dsrun  # noqa: F401 - installs the deepspeed alias
from dsrun.errors import DsrunConfigError

# DeepSpeed 0.19.8's deepspeed.profiling.constants (the *_FORMAT text aside)
DEEPSPEED_CONSTANTS = {
    "FLOPS_PROFILER": "flops_profiler",
    "FLOPS_PROFILER_ENABLED": "enabled", "FLOPS_PROFILER_ENABLED_DEFAULT": False,
    "FLOPS_PROFILER_RECOMPUTE_FWD_FACTOR": "recompute_fwd_factor",
    "FLOPS_PROFILER_RECOMPUTE_FWD_FACTOR_DEFAULT": 0.0,
    "FLOPS_PROFILER_PROFILE_STEP": "profile_step", "FLOPS_PROFILER_PROFILE_STEP_DEFAULT": 1,
    "FLOPS_PROFILER_MODULE_DEPTH": "module_depth", "FLOPS_PROFILER_MODULE_DEPTH_DEFAULT": -1,
    "FLOPS_PROFILER_TOP_MODULES": "top_modules", "FLOPS_PROFILER_TOP_MODULES_DEFAULT": 1,
    "FLOPS_PROFILER_DETAILED": "detailed", "FLOPS_PROFILER_DETAILED_DEFAULT": True,
    "FLOPS_PROFILER_OUTPUT_FILE": "output_file", "FLOPS_PROFILER_OUTPUT_FILE_DEFAULT": None,
}
# DeepSpeed 0.19.8: repr(DeepSpeedFlopsProfilerConfig({})) as a dict, in its order
DEEPSPEED_DEFAULTS = {"enabled": False, "recompute_fwd_factor": 0.0, "profile_step": 1,
                      "module_depth": -1, "top_modules": 1, "detailed": True,
                      "output_file": None}


def test_constants_are_deepspeeds() -> None:
    for path in ("deepspeed.profiling.constants", "deepspeed.profiling.config"):
        module = importlib.import_module(path)
        assert {name: getattr(module, name) for name in DEEPSPEED_CONSTANTS} == \
            DEEPSPEED_CONSTANTS, path
        assert '"flops_profiler": {' in module.FLOPS_PROFILER_FORMAT


def test_config_reads_the_section_of_a_whole_config() -> None:
    from deepspeed.profiling.config import DeepSpeedFlopsProfilerConfig

    defaults = DeepSpeedFlopsProfilerConfig({"train_batch_size": 8})
    assert defaults.repr() == DEEPSPEED_DEFAULTS
    assert list(defaults.repr()) == list(DEEPSPEED_DEFAULTS)  # DeepSpeed's order, in repr too
    assert repr(defaults).startswith('{\n    "enabled": false,\n    "recompute_fwd_factor": 0.0')
    config = DeepSpeedFlopsProfilerConfig({
        "train_batch_size": 8,
        "flops_profiler": {"enabled": True, "profile_step": 3, "module_depth": 2,
                           "top_modules": 3, "detailed": False, "output_file": "prof.txt",
                           "recompute_fwd_factor": 1.0}})
    assert (config.enabled, config.profile_step, config.module_depth, config.top_modules,
            config.detailed, config.output_file, config.recompute_fwd_factor) == \
        (True, 3, 2, 3, False, "prof.txt", 1.0)


def test_config_is_strict() -> None:
    from deepspeed.profiling.config import DeepSpeedFlopsProfilerConfig

    with pytest.raises(DsrunConfigError, match='"enabeld".*did you mean "enabled"'):
        DeepSpeedFlopsProfilerConfig({"flops_profiler": {"enabeld": True}})
    with pytest.raises(DsrunConfigError, match=r'"flops_profiler.top_modules".*integer >= 1'):
        DeepSpeedFlopsProfilerConfig({"flops_profiler": {"top_modules": 0}})
    with pytest.raises(DsrunConfigError, match="takes a config dict, not list"):
        DeepSpeedFlopsProfilerConfig([])  # type: ignore[arg-type]
