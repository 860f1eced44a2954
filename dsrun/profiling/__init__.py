"""Profiling tools: DeepSpeed's flops profiler (:mod:`.flops_profiler`; the
engine's profiled step in :mod:`.engine_step`; the per-module attributes
and ``get_module_flops`` & co. in :mod:`.module_attrs`) and DeepSpeed's
``deepspeed.profiling.config`` / ``.constants`` (:mod:`.config`,
:mod:`.constants`)."""
