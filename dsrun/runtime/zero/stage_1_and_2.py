"""DeepSpeed's ``deepspeed.runtime.zero.stage_1_and_2`` module path: its ZeRO
1/2 optimizer class (dsrun's :class:`~.sharded.ZeroOptimizer`, for the
``isinstance`` checks scripts make) and the stage-2 memory estimators
(:mod:`.estimate`, dsrun's numbers)."""

from __future__ import annotations

from dsrun.runtime.zero.estimate import (
    estimate_zero2_model_states_mem_needs,
    estimate_zero2_model_states_mem_needs_all_cold,
    estimate_zero2_model_states_mem_needs_all_live,
    model_to_params,
)
from dsrun.runtime.zero.sharded import ZeroOptimizer

DeepSpeedZeroOptimizer = ZeroOptimizer

__all__ = [
    "DeepSpeedZeroOptimizer", "estimate_zero2_model_states_mem_needs",
    "estimate_zero2_model_states_mem_needs_all_cold",
    "estimate_zero2_model_states_mem_needs_all_live", "model_to_params",
]
