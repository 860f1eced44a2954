"""DeepSpeed's timers (dsrun/utils/timer.py) on a fake clock: the
wall-clock group's elapsed/reset/log semantics and the throughput timer's
warm-up steps and averages, as DeepSpeed 0.19.8 computes them."""

from __future__ import annotations

import logging
import math

import pytest

from dsrun.errors import DsrunConfigError
from dsrun.utils import timer as timer_mod
from dsrun.utils.timer import (
    NoopTimer,
    SynchronizedWallClockTimer,
    ThroughputTimer,
    ThroughputTimerConfig,
    trim_mean,
)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    c = Clock()
    monkeypatch.setattr(timer_mod.time, "time", c)
    return c


def test_wall_clock_timer_sums_intervals_and_resets(clock: Clock) -> None:
    timers = SynchronizedWallClockTimer()
    t = timers("fwd")
    assert timers("fwd") is t and timers.get_timers() == {"fwd": t}
    for seconds in (0.5, 0.25):
        t.start()
        clock.now += seconds
        t.stop()
    assert t.elapsed(reset=False) == pytest.approx(750.0)
    t.start()
    clock.now += 1.0
    # a running timer counts up to now and keeps running
    assert t.elapsed() == pytest.approx(1750.0) and t.started_
    clock.now += 2.0
    t.stop()
    assert t.elapsed() == pytest.approx(2000.0) and t.elapsed() == 0.0
    with pytest.raises(RuntimeError, match="not started"):
        t.stop()
    t.start()
    with pytest.raises(RuntimeError, match="already been started"):
        t.start()


def test_wall_clock_log_and_mean(clock: Clock, capsys: pytest.CaptureFixture[str]) -> None:
    timers = SynchronizedWallClockTimer()
    for seconds in (0.002, 0.004, 0.006):
        timers("step").start()
        clock.now += seconds
        timers("step").stop()
    assert timers("step").mean() == pytest.approx(4.0)
    assert timers.get_mean(["step", "never"]) == {"step": pytest.approx(4000.0)}
    timers.log(["step", "never"], normalizer=2.0)
    printed = capsys.readouterr().out
    assert "time (ms) | step: 6.00" in printed and "never" not in printed
    assert timers("step").elapsed() == 0.0  # log resets by default


def test_wall_clock_log_prints_whatever_the_log_level(
        clock: Clock, capsys: pytest.CaptureFixture[str]) -> None:
    """DeepSpeed prints the line (print_dist): a script that quiets the
    logger (Lightning sets it to WARNING) keeps the timings it asked for."""
    from dsrun.utils import logger

    timers = SynchronizedWallClockTimer()
    timers("b").start()
    clock.now += 0.001
    timers("b").stop()
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        timers.log(["b"])
    finally:
        logger.setLevel(level)
    assert "time (ms) | b: 1.00" in capsys.readouterr().out


def test_trim_mean_and_noop() -> None:
    assert trim_mean([], 0.1) == 0.0
    assert trim_mean([100.0, 1.0, 2.0, 3.0, -50.0, 2.0, 2.0, 2.0, 2.0, 2.0], 0.1) == 2.0
    noop = NoopTimer()
    noop("x").start()
    noop("x").stop()
    assert noop("x").elapsed() == 0 and noop.get_timers() == {}


def test_throughput_timer_skips_warmup_steps(clock: Clock) -> None:
    tput = ThroughputTimer(ThroughputTimerConfig(), batch_size=8, start_step=2)
    assert tput.avg_samples_per_sec() == -math.inf
    for step in range(5):
        for micro in range(2):  # two micro-steps per optimizer step, 0.5 s each
            tput.start()
            clock.now += 0.5
            tput.stop(global_step=micro == 1)
        if step < 2:
            assert tput.total_elapsed_time == 0  # warm-up: not timed
            assert tput.avg_samples_per_sec() == -math.inf
    assert tput.global_step_count == 5 and tput.micro_step_count == 10
    # steps 3-5 were timed, 1 s each (two micro-steps): 8 samples per second
    assert tput.total_elapsed_time == pytest.approx(3.0)
    assert tput.avg_samples_per_sec() == pytest.approx(8.0)
    tput.stop(global_step=True)  # not started: nothing counted
    assert tput.global_step_count == 5


def test_throughput_timer_reports_and_can_be_disabled(clock: Clock) -> None:
    lines: list[str] = []
    tput = ThroughputTimer(None, batch_size=4, start_step=0, steps_per_output=2,
                           logging_fn=lines.append)
    for _ in range(4):
        tput.start()
        clock.now += 0.25
        tput.stop(global_step=True)
    assert len(lines) == 2 and "global_step=4, RunningAvgSamplesPerSec=16.0" in lines[1]
    off = ThroughputTimer(ThroughputTimerConfig(enabled=False), batch_size=4)
    off.start()
    off.stop(global_step=True)
    assert off.global_step_count == 0 and not off.started


def test_the_configs_timers_section_is_checked_with_the_rest() -> None:
    """``timers.throughput`` is a config section: a wrong key or value is a
    config error where every other one is (also in the launcher's check)."""
    from dsrun.runtime.config import resolve

    def timers(section: dict) -> object:
        return resolve({"train_batch_size": 4, "timers": section}, dp_size=1,
                       dp_source="test").timers.throughput

    assert timers({}) == timers({"throughput": {}})
    assert timers({"throughput": {"enabled": False}}).enabled is False
    with pytest.raises(DsrunConfigError, match='did you mean "enabled"'):
        timers({"throughput": {"enable": True}})
    with pytest.raises(DsrunConfigError, match='"timers.throughput.synchronized"'):
        timers({"throughput": {"synchronized": "false"}})


def test_deepspeed_module_path() -> None:
    # importing dsrun (above, for dsrun.utils.timer) installed the alias
    from deepspeed.utils.timer import SynchronizedWallClockTimer as Aliased

    assert Aliased is SynchronizedWallClockTimer
