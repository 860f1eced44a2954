"""``deepspeed.ops.adagrad``'s :class:`DeepSpeedCPUAdagrad` (DeepSpeed's host
Adagrad for ZeRO-Offload) with its constructor arguments, on
``torch.optim.Adagrad``: DeepSpeed's kernel does the same arithmetic
(``sum += g^2``, ``w -= lr * g / (sqrt(sum) + eps)``, weight decay added to
the gradient first). Nothing is compiled; it steps parameters on any
device. ``fp32_optimizer_states`` is accepted and recorded; the sums live in
the parameters' dtype, as torch's Adagrad keeps them (under ZeRO-Offload,
where DeepSpeed uses this class, the parameters it steps are fp32 masters).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from dsrun.errors import DsrunConfigError

__all__ = ["DeepSpeedCPUAdagrad"]


class DeepSpeedCPUAdagrad(torch.optim.Adagrad):
    def __init__(self, model_params: Iterable[Any], lr: float = 1e-2, eps: float = 1e-10,
                 weight_decay: float = 0.0, amsgrad: bool = False,
                 fp32_optimizer_states: bool = True) -> None:
        if amsgrad:
            raise DsrunConfigError("DeepSpeedCPUAdagrad does not support amsgrad (nor does "
                                   "DeepSpeed's kernel)")
        super().__init__(model_params, lr=lr, eps=eps, weight_decay=weight_decay)
        self.fp32_optimizer_states = bool(fp32_optimizer_states)
