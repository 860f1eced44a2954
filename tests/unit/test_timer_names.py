"""DeepSpeed's timer-name constants (dsrun/runtime/timer_names.py): the
values of DeepSpeed 0.19.8's ``deepspeed.runtime.engine`` (printed from
bench/.venv-ds and pasted here), the one definition that
``deepspeed.utils.timer`` and the engine's ``get_wall_clock_timers``
use."""

from __future__ import annotations

import dsrun  # noqa: F401 - installs the deepspeed alias
from dsrun.runtime import engine_info, timer_names

DEEPSPEED_TIMERS = {
    "FORWARD_MICRO_TIMER": "fwd_microstep", "FORWARD_GLOBAL_TIMER": "fwd",
    "BACKWARD_MICRO_TIMER": "bwd_microstep", "BACKWARD_GLOBAL_TIMER": "bwd",
    "BACKWARD_INNER_MICRO_TIMER": "bwd_inner_microstep", "BACKWARD_INNER_GLOBAL_TIMER": "bwd_inner",
    "BACKWARD_REDUCE_MICRO_TIMER": "bwd_allreduce_microstep",
    "BACKWARD_REDUCE_GLOBAL_TIMER": "bwd_allreduce",
    "STEP_MICRO_TIMER": "step_microstep", "STEP_GLOBAL_TIMER": "step",
}


def test_values_are_deepspeeds() -> None:
    assert {name: getattr(timer_names, name) for name in DEEPSPEED_TIMERS} == DEEPSPEED_TIMERS
    assert set(timer_names.__all__) == set(DEEPSPEED_TIMERS) | {"GLOBAL_TIMERS", "MICRO_TIMERS"}
    assert timer_names.GLOBAL_TIMERS == ("fwd", "bwd", "bwd_inner", "bwd_allreduce", "step")
    assert timer_names.MICRO_TIMERS == tuple(f"{name}_microstep"
                                             for name in timer_names.GLOBAL_TIMERS)


def test_deepspeed_utils_timer_exports_the_same_names() -> None:
    import deepspeed.utils.timer as ds_timer

    assert {name: getattr(ds_timer, name) for name in DEEPSPEED_TIMERS} == DEEPSPEED_TIMERS


def test_wall_clock_timers_report_under_the_global_names() -> None:
    assert tuple(engine_info.WALL_CLOCK_TIMERS) == timer_names.GLOBAL_TIMERS


def test_deepspeed_runtime_engine_exports_the_same_names() -> None:
    import deepspeed.runtime.engine as ds_engine

    assert {name: getattr(ds_engine, name) for name in DEEPSPEED_TIMERS} == DEEPSPEED_TIMERS
