"""Profiling tools: DeepSpeed's flops profiler (:mod:`.flops_profiler`; the
engine's profiled step in :mod:`.engine_step`)."""
