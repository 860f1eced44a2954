"""DeepSpeed's ``deepspeed.moe`` package path. dsrun has no mixture-of-experts
layers (DeepSpeed's ``MoE``, expert parallelism): only the parameter-group
helpers of :mod:`.utils` are here, for scripts that import them at the top
and train without expert parameters (DeepSpeedExamples'
``cifar10_deepspeed.py``)."""

from typing import Any

from dsrun._absent import module_getattr_error
from dsrun.moe import utils

__all__ = ["utils"]


def __getattr__(name: str) -> Any:
    raise module_getattr_error(__name__, name)  # layer, experts: what to do instead
