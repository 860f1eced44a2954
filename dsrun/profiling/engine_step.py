"""The ``flops_profiler`` config section at work: one profiled optimizer step.

DeepSpeed's semantics: on global rank 0 (in a pipeline, on the first
data-parallel replica of every stage, each reporting its own layers; with
``output_file`` each stage writes ``NAME.stageS.EXT``), the optimizer step during which
``engine.global_steps == profile_step`` is profiled, and the report is
printed (or written to ``output_file``) when that step's ``engine.step()``
has run. dsrun's profile covers the whole optimizer step: every
micro-batch's forward (per module) and backward (counted as a whole), and
the optimizer step itself, so with gradient accumulation the figures are
for all micro-batches of the step, and the summary says how many.

Other ranks run unprofiled: the counting adds no collective, so a profiled
rank 0 only runs a little slower for that one step.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Iterator, Sequence
from typing import Any, Optional

import torch

from dsrun.errors import DsrunConfigError
from dsrun.profiling.flops_profiler.profiler import FlopsProfiler, synchronize_cuda
from dsrun.profiling.tree import Summary

log = logging.getLogger("dsrun.profiling")

__all__ = ["StepProfiler", "make_flops_profiler"]


def make_flops_profiler(engine: Any) -> tuple[Optional[FlopsProfiler], Optional[StepProfiler]]:
    """``(engine.flops_profiler, the step driver on a profiling rank)``;
    ``(None, None)`` when the section is off. An ``output_file`` that cannot
    be written is a config error now, not a lost profile later."""
    cfg = engine.config.flops_profiler
    if not cfg.enabled:
        return None, None
    profiles, stage = profiling_role(engine)
    output = stage_file(cfg.output_file, stage) if cfg.output_file else None
    if output and profiles:
        check_output_file(output, engine.config.source)
    profiler = FlopsProfiler(engine.module, ds_engine=engine,
                             recompute_fwd_factor=cfg.recompute_fwd_factor)
    driver = StepProfiler(engine, profiler, stage, output) if profiles else None
    return profiler, driver


def profiling_role(engine: Any) -> tuple[bool, Optional[tuple[int, int]]]:
    """Whether this rank profiles, and its ``(stage, stages)`` in a
    pipeline: global rank 0 of a data-parallel engine, the first replica of
    every stage of a pipeline (each stage runs other layers)."""
    if engine.is_pipe_parallel:
        grid = engine.module.grid  # the PipelineModule's (the engine sets its own later)
        return grid.data_parallel_id == 0, (grid.stage_id, grid.stages)
    return engine.global_rank == 0, None


def stage_file(path: str, stage: Optional[tuple[int, int]]) -> str:
    """``output_file`` for one pipeline stage: ``flops.txt`` ->
    ``flops.stage1.txt`` when there are several stages."""
    if stage is None or stage[1] == 1:
        return path
    root, ext = os.path.splitext(path)
    return f"{root}.stage{stage[0]}{ext}"


def check_output_file(path: str, source: str) -> None:
    """The report's file must be creatable: its directory exists and is
    writable, and the path is not a directory."""
    where = f"flops_profiler.output_file in {source}"
    directory = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise DsrunConfigError(f"{where} is a directory: {path!r}")
    if not os.path.isdir(directory):
        raise DsrunConfigError(f"{where}: directory {directory!r} does not exist")
    if not os.access(directory, os.W_OK):
        raise DsrunConfigError(f"{where}: directory {directory!r} is not writable")


def _batch_size(args: Sequence[Any], kwargs: dict[str, Any]) -> int:
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            return int(value.shape[0])
        if isinstance(value, (list, tuple)) and value:
            found = _batch_size(value, {})
            if found:
                return found
        if isinstance(value, dict) and value:
            found = _batch_size((), value)
            if found:
                return found
    return 0


class StepProfiler:
    """Drives a :class:`FlopsProfiler` through the engine's forward,
    backward and step at the configured step (on the profiling ranks:
    :func:`profiling_role`)."""

    def __init__(self, engine: Any, profiler: FlopsProfiler,
                 stage: Optional[tuple[int, int]] = None,
                 output_file: Optional[str] = None) -> None:
        self.engine = engine
        self.profiler = profiler
        self.stage = stage
        self.output_file = output_file
        self.config = engine.config.flops_profiler
        self.done = False
        self._backward_s = 0.0
        self._samples = 0
        self._micro = 0
        if self.config.recompute_fwd_factor:
            log.info("flops_profiler.recompute_fwd_factor is not needed with dsrun: the "
                     "backward's flops are counted, recomputation included")

    def active(self) -> bool:
        """This is the profiled step (and its report is not written yet)."""
        return not self.done and self.engine.global_steps == self.config.profile_step

    @contextlib.contextmanager
    def forward(self, args: Sequence[Any], kwargs: dict[str, Any]) -> Iterator[None]:
        # a forward with gradients off (an evaluation or generation pass in
        # the profiled step) is not a training micro-batch: counting it
        # would add its MACs, samples and time to the step's figures
        if not self.active() or not torch.is_grad_enabled():
            yield
            return
        if self._micro == 0:
            log.info("flops profiler: profiling step %d", self.config.profile_step)
        self._micro += 1
        self._samples += _batch_size(args, kwargs)
        with self.profiler.counting("forward"):
            yield

    @contextlib.contextmanager
    def backward(self) -> Iterator[None]:
        if not self.active() or self._micro == 0:
            yield
            return
        started = time.perf_counter()
        overhead = self.profiler._overhead
        with self.profiler.counting("backward"):
            yield
        synchronize_cuda()
        self._backward_s += time.perf_counter() - started - (self.profiler._overhead - overhead)

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        """Around the optimizer step (at an accumulation boundary)."""
        if not self.active() or self._micro == 0:
            yield
            return
        started = time.perf_counter()
        yield
        synchronize_cuda()
        step_s = time.perf_counter() - started
        self._report(step_s)

    def _report(self, step_s: float) -> None:
        root = self.profiler.module_stats()
        assert root is not None
        engine = self.engine
        # the profiled step is the configured one; global_steps has moved past it
        step = self.config.profile_step
        summary = Summary(step=step, world_size=engine.world_size,
                          dp_size=engine.dp_world_size, micro_batches=self._micro,
                          samples=self._samples, params=root.params, fwd_flops=root.flops,
                          fwd_macs=root.macs, bwd_flops=self.profiler.backward_flops,
                          fwd_latency=root.latency, bwd_latency=self._backward_s,
                          step_latency=step_s, stage=self.stage)
        cfg = self.config
        try:
            self.profiler.print_model_profile(profile_step=step,
                                              module_depth=cfg.module_depth,
                                              top_modules=cfg.top_modules, detailed=cfg.detailed,
                                              output_file=self.output_file, summary=summary)
        except OSError as exc:
            log.error("flops profiler: cannot write %s: %s", self.output_file, exc)
        else:
            if self.output_file:
                log.info("flops profiler: profile of step %d written to %s", step,
                         self.output_file)
        finally:
            self.profiler.end_profile()
            self.done = True
