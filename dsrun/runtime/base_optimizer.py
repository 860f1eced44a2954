"""DeepSpeed's ``deepspeed.runtime.base_optimizer`` classes, for the
``isinstance`` checks libraries make: Lightning Fabric's ``load()`` loads an
optimizer's state only when it is a torch ``Optimizer`` or a
``DeepSpeedOptimizer``. dsrun's ZeRO optimizers (stages 1-2 and 3) are not
torch optimizers, so they are registered here as DeepSpeed's
``ZeROOptimizer`` (and so ``DeepSpeedOptimizer``) without inheriting from
them: the classes carry no behaviour.
"""

from __future__ import annotations

import abc

from dsrun.runtime.zero.sharded import ZeroOptimizer
from dsrun.runtime.zero.stage3 import ZeroStage3

__all__ = ["DeepSpeedOptimizer", "ZeROOptimizer"]


class DeepSpeedOptimizer(metaclass=abc.ABCMeta):  # noqa: B024 - a marker, as DeepSpeed's
    """What DeepSpeed's optimizer wrappers are (a marker class)."""


class ZeROOptimizer(DeepSpeedOptimizer):  # noqa: B024
    """What DeepSpeed's ZeRO optimizers are: dsrun's are registered."""


ZeROOptimizer.register(ZeroOptimizer)
ZeROOptimizer.register(ZeroStage3)
