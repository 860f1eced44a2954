"""DeepSpeed's wall-clock timer names (``deepspeed.runtime.engine`` and
``deepspeed.utils.timer`` export them; the values are DeepSpeed 0.19.8's).

DeepSpeed's engine keeps one timer per phase under these names in
``engine.timers``; ``*_GLOBAL_TIMER`` time a phase over the whole
optimizer step, ``*_MICRO_TIMER`` one micro-step. dsrun times each phase
per optimizer step (:mod:`dsrun.runtime.monitor.timers`) and reports the
global ones by these names (``engine.get_wall_clock_timers()``); scripts
that look timers up by DeepSpeed's constants use the same strings.
"""

from __future__ import annotations

__all__ = [
    "BACKWARD_GLOBAL_TIMER", "BACKWARD_INNER_GLOBAL_TIMER", "BACKWARD_INNER_MICRO_TIMER",
    "BACKWARD_MICRO_TIMER", "BACKWARD_REDUCE_GLOBAL_TIMER", "BACKWARD_REDUCE_MICRO_TIMER",
    "FORWARD_GLOBAL_TIMER", "FORWARD_MICRO_TIMER", "GLOBAL_TIMERS", "MICRO_TIMERS",
    "STEP_GLOBAL_TIMER", "STEP_MICRO_TIMER",
]

FORWARD_MICRO_TIMER = "fwd_microstep"
FORWARD_GLOBAL_TIMER = "fwd"
BACKWARD_MICRO_TIMER = "bwd_microstep"
BACKWARD_GLOBAL_TIMER = "bwd"
BACKWARD_INNER_MICRO_TIMER = "bwd_inner_microstep"
BACKWARD_INNER_GLOBAL_TIMER = "bwd_inner"
BACKWARD_REDUCE_MICRO_TIMER = "bwd_allreduce_microstep"
BACKWARD_REDUCE_GLOBAL_TIMER = "bwd_allreduce"
STEP_MICRO_TIMER = "step_microstep"
STEP_GLOBAL_TIMER = "step"

#: one micro-step's timers, in DeepSpeed's order (forward, backward, its
#: inner part and its reduction wait, step)
MICRO_TIMERS = (FORWARD_MICRO_TIMER, BACKWARD_MICRO_TIMER, BACKWARD_INNER_MICRO_TIMER,
                BACKWARD_REDUCE_MICRO_TIMER, STEP_MICRO_TIMER)
#: the optimizer step's timers, in the same order
GLOBAL_TIMERS = (FORWARD_GLOBAL_TIMER, BACKWARD_GLOBAL_TIMER, BACKWARD_INNER_GLOBAL_TIMER,
                 BACKWARD_REDUCE_GLOBAL_TIMER, STEP_GLOBAL_TIMER)
