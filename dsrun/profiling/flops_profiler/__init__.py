"""DeepSpeed's ``deepspeed.profiling.flops_profiler``: the profiler lives in
:mod:`.profiler` (DeepSpeed's module name, for ``from
deepspeed.profiling.flops_profiler.profiler import FlopsProfiler``)."""

from dsrun.profiling.flops_profiler.profiler import (
    FlopsProfiler,
    duration_to_string,
    flops_to_string,
    get_model_profile,
    get_module_duration,
    get_module_flops,
    get_module_macs,
    macs_to_string,
    number_to_string,
    params_to_string,
)

__all__ = [
    "FlopsProfiler", "get_model_profile", "get_module_duration", "get_module_flops",
    "get_module_macs", "duration_to_string", "flops_to_string", "macs_to_string",
    "number_to_string", "params_to_string",
]
