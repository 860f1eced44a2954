"""A pipeline's metrics without processes: which part each schedule
instruction is timed under, the pipeline timers, the stage's log line, and
when a step's times are closed."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from dsrun.runtime.config import DsrunConfig, resolve
from dsrun.runtime.monitor import events as ev
from dsrun.runtime.monitor.timers import CommWaits, StepTimers
from dsrun.runtime.pipe import schedule as sched
from dsrun.runtime.pipe.metrics import (
    INSTRUCTION_PARTS,
    PipelineMonitor,
    busy_share,
    format_pipeline_breakdown,
)
from tests.unit.test_monitor import FakeClock, read_csv


def _instruction_types() -> set[type]:
    found, todo = set(), [sched.Instruction]
    while todo:
        for sub in todo.pop().__subclasses__():
            found.add(sub)
            todo.append(sub)
    return found - {sched.MicroBatchInstruction}


def test_every_instruction_is_timed_under_a_pipeline_part() -> None:
    untimed = _instruction_types() - set(INSTRUCTION_PARTS)
    assert untimed == {sched.OptimizerStep}  # the monitor's optimizer_step times it
    assert set(INSTRUCTION_PARTS.values()) <= set(ev.PIPELINE_PARTS)
    assert set(ev.PIPELINE_ONLY_PARTS) <= set(INSTRUCTION_PARTS.values())
    assert INSTRUCTION_PARTS[sched.ReduceGrads] == "backward"  # DeepSpeed's backward_allreduce


def test_pipeline_parts_have_event_names_and_plain_timers_refuse_them() -> None:
    assert ev.time_event("pipe_recv_grad") == "Train/Samples/elapsed_time_ms_pipe_recv_grad"
    assert ev.PIPELINE_PARTS[:len(ev.BREAKDOWN_PARTS)] == ev.BREAKDOWN_PARTS
    clock = FakeClock()
    with pytest.raises(ValueError, match="unknown phase 'pipe_recv_grad'"):
        StepTimers(True, comm=CommWaits(clock), clock=clock).phase("pipe_recv_grad")
    with pytest.raises(ValueError, match="must include"):
        StepTimers(True, comm=CommWaits(clock), clock=clock, parts=("forward",))


def test_pipeline_timers_split_a_batch_into_its_parts() -> None:
    clock = FakeClock()
    comm = CommWaits(clock)
    timers = StepTimers(True, comm=comm, clock=clock, parts=ev.PIPELINE_PARTS)
    costs = {"batch_input": 0.001, "pipe_recv_grad": 0.004, "pipe_send": 0.002,
             "forward": 0.010, "backward": 0.020, "tied_reduce": 0.003}
    for part, seconds in costs.items():
        with timers.phase(part):
            clock.now += seconds
    with timers.phase("backward"):  # ReduceGrads: the wait is backward_allreduce
        with comm.timed("reduce"):
            clock.now += 0.005
    timers.end_step(iteration_s=0.05)
    means = timers.take_means()
    assert set(means) == set(ev.PIPELINE_PARTS)
    assert means["backward"] == pytest.approx(25.0)
    assert means["backward_allreduce"] == pytest.approx(5.0) == means["comm_reduce"]
    assert means["backward_inner"] == pytest.approx(20.0)
    for part in ("batch_input", "pipe_recv_grad", "pipe_send", "forward", "tied_reduce"):
        assert means[part] == pytest.approx(1000 * costs[part])
    assert means["pipe_recv_input"] == 0.0


def test_a_stages_line_and_its_busy_share() -> None:
    means = dict.fromkeys(ev.PIPELINE_PARTS, 0.0)
    means.update(forward=2.0, backward=7.0, backward_inner=6.0, backward_allreduce=1.0,
                 batch_input=0.5, pipe_recv_input=0.25, pipe_recv_grad=1.25, pipe_send=0.0,
                 tied_reduce=0.5, step=3.0, monitor=0.5, iteration=15.0)
    assert busy_share(means) == pytest.approx(8.0 / 10.0)
    assert format_pipeline_breakdown(1, means, 4, 0.8) == (
        "pipeline stage 1: time (ms per optimizer step, mean of 4): input 0.50 | forward 2.00 "
        "| backward 7.00 (data-parallel reduce wait 1.00) | receive wait 1.50 (activations "
        "0.25, gradients 1.25) | send 0.00 | tied reduce 0.50 | step 3.00 (monitor 0.50) | "
        "iteration 15.00; busy 80% (1F1B ideal 80%)")
    assert busy_share(dict.fromkeys(ev.PIPELINE_PARTS, 0.0)) == 0.0


def config(tmp_path: Path) -> DsrunConfig:
    return resolve({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4,
                    "steps_per_print": 2, "wall_clock_breakdown": True,
                    "csv_monitor": {"enabled": True, "output_path": str(tmp_path),
                                    "job_name": "pipe"}},
                   dp_size=1, dp_source="test", environ={})


class Engine:
    """What the monitor reads from an engine at a step's end."""

    global_steps = 0
    global_samples = 0


def monitor(tmp_path: Path, *, rank: int = 0, replica: int = 0
            ) -> tuple[PipelineMonitor, FakeClock]:
    mon = PipelineMonitor(config(tmp_path), rank=rank, group=None,
                          device=torch.device("cpu"), stage=rank, stages=2, replica=replica)
    clock = FakeClock()
    mon.timers = StepTimers(True, comm=CommWaits(clock), clock=clock, parts=mon.PARTS)
    return mon, clock


def test_instructions_of_evaluation_batches_are_not_timed(tmp_path: Path) -> None:
    mon, clock = monitor(tmp_path)
    with mon.instruction(sched.Forward(0), "eval"), mon.sends("eval"):
        clock.now += 1.0
    with mon.instruction(sched.OptimizerStep(), "train"):  # timed by optimizer_step
        clock.now += 1.0
    with mon.instruction(sched.RecvGrad(0), "train"):
        clock.now += 0.002
    with mon.sends("train"):
        clock.now += 0.001
    mon.timers.end_step(0.0)
    means = mon.timers.take_means()
    assert means["forward"] == 0.0 and means["step"] == 0.0
    assert means["pipe_recv_grad"] == pytest.approx(2.0)
    assert means["pipe_send"] == pytest.approx(1.0)


def test_a_steps_times_close_after_its_batchs_sends(tmp_path: Path,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    mon, clock = monitor(tmp_path)
    engine = Engine()
    lines = []
    for step in (1, 2):
        engine.global_steps, engine.global_samples = step, 8 * step
        with mon.instruction(sched.Forward(0), "train"):
            clock.now += 0.010
        mon.end_step(engine, 0.1)  # at the optimizer step: left open...
        with mon.sends("train"):  # ... for the end-of-batch wait
            clock.now += 0.004
        with caplog.at_level("INFO", logger="dsrun.runtime.monitor"):
            mon.batch_finished()
        lines += [r.getMessage() for r in caplog.records if "pipeline stage" in r.getMessage()]
        caplog.clear()
    assert lines == [format_pipeline_breakdown(0, _means(tmp_path), 2, 0.8)]
    assert _means(tmp_path)["pipe_send"] == pytest.approx(4.0)
    assert _means(tmp_path)["forward"] == pytest.approx(10.0)
    # writing the breakdown counts in the next step's step and monitor parts
    mon.timers.end_step(0.0)
    after = mon.timers.take_means()
    assert after["step"] == after["monitor"] > 0.0


def _means(tmp_path: Path) -> dict[str, float]:
    out = {}
    for part in ev.PIPELINE_PARTS:
        rows = read_csv(tmp_path / "pipe" / ev.csv_filename(ev.time_event(part)))
        assert rows[0] == ["step", f"elapsed_time_ms_{part}"] and len(rows) == 2
        out[part] = float(rows[1][1])
    return out


def test_only_each_stages_first_replica_logs_its_line(tmp_path: Path) -> None:
    means: dict[str, Any] = dict.fromkeys(ev.PIPELINE_PARTS, 1.0)
    assert monitor(tmp_path, rank=1)[0].breakdown_line(means, 2).startswith(
        "pipeline stage 1: ")
    assert monitor(tmp_path, rank=3, replica=1)[0].breakdown_line(means, 2) is None
    mon = monitor(tmp_path, rank=1)[0]
    assert mon.grad_norm_before_step(Engine()) is None  # measured inside the step
    mon.note_grad_norm(torch.tensor(2.5))
    assert mon._grad_norm == 2.5
