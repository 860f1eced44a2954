"""``deepspeed.ops.lion``'s optimizers: :class:`FusedLion` (DeepSpeed's
multi-tensor CUDA Lion) and :class:`DeepSpeedCPULion` (its host Lion for
ZeRO-Offload), with DeepSpeed's constructor arguments, both
:class:`dsrun.runtime.optimizers.Lion` underneath (its docstring has the
update and where it differs from DeepSpeed's kernels: a zero ``c`` only
decays). As DeepSpeed's, FusedLion keeps a 16-bit parameter's momentum in
its dtype, DeepSpeedCPULion in fp32 unless ``fp32_optimizer_states=False``.
Nothing is compiled; both step parameters on any device.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from dsrun.runtime.optimizers import Lion

__all__ = ["DeepSpeedCPULion", "FusedLion"]


class FusedLion(Lion):
    def __init__(self, params: Iterable[Any], lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), weight_decay: float = 0.0,
                 set_grad_none: bool = True) -> None:
        super().__init__(params, lr=lr, betas=betas, weight_decay=weight_decay)


class DeepSpeedCPULion(Lion):
    def __init__(self, model_params: Iterable[Any], lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), weight_decay: float = 0.0,
                 fp32_optimizer_states: bool = True) -> None:
        self.fp32_states = bool(fp32_optimizer_states)
        super().__init__(model_params, lr=lr, betas=betas, weight_decay=weight_decay)
