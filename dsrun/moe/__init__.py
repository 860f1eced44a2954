"""DeepSpeed's ``deepspeed.moe`` package path. dsrun has no mixture-of-experts
layers (DeepSpeed's ``MoE``, expert parallelism): only the parameter-group
helpers of :mod:`.utils` are here, for scripts that import them at the top
and train without expert parameters (DeepSpeedExamples'
``cifar10_deepspeed.py``)."""

from dsrun.moe import utils

__all__ = ["utils"]
