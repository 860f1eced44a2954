"""``dsrun.zero``: what DeepSpeed scripts use as ``deepspeed.zero``.

``import dsrun as deepspeed`` then ``deepspeed.zero.Init(...)``,
``deepspeed.zero.GatheredParameters(...)``,
``deepspeed.zero.register_external_parameter(...)``. Importing this module
imports torch (``import dsrun`` alone does not). Implementations live in
:mod:`dsrun.runtime.zero.init` (contexts) and :mod:`dsrun.runtime.zero.stage3`
(the stage-3 optimizer the engine builds).
"""

from __future__ import annotations

from dsrun.runtime.zero.init import (
    GatheredParameters,
    Init,
    register_external_parameter,
    unregister_external_parameter,
)
from dsrun.runtime.zero.partitioned import ZeroParameter, ZeroParamStatus

__all__ = [
    "GatheredParameters", "Init", "ZeroParamStatus", "ZeroParameter",
    "register_external_parameter", "unregister_external_parameter",
]
