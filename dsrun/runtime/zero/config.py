"""DeepSpeed's ``deepspeed.runtime.zero.config`` module path: its
:class:`ZeroStageEnum`, which scripts compare ``zero_optimization_stage()``
with. (dsrun's ZeRO config itself is ``ZeroConfig`` in
:mod:`dsrun.runtime.config_sections`.)"""

from __future__ import annotations

from enum import Enum

__all__ = ["ZeroStageEnum"]


class ZeroStageEnum(int, Enum):
    disabled = 0
    optimizer_states = 1
    gradients = 2
    weights = 3
    max_stage = 3  # an alias of weights, as in DeepSpeed
