"""``dsrun.ops``: what DeepSpeed scripts import from ``deepspeed.ops``.

Only the optimizers scripts build themselves are here
(``from deepspeed.ops.adam import FusedAdam, DeepSpeedCPUAdam``,
``deepspeed.ops.lion``'s ``FusedLion``, ``DeepSpeedCPULion``,
``deepspeed.ops.lamb``'s ``FusedLamb`` and ``deepspeed.ops.adagrad``'s
``DeepSpeedCPUAdagrad``); they run on torch's Adam and Adagrad and dsrun's
Lion and Lamb, so nothing is compiled (:mod:`dsrun.ops.adam`,
:mod:`dsrun.ops.lion`, :mod:`dsrun.ops.lamb`, :mod:`dsrun.ops.adagrad`). Importing
this package imports torch (``import dsrun`` alone does not).
"""

from __future__ import annotations

from typing import Any

from dsrun._absent import module_getattr_error
from dsrun.ops import adagrad, adam, lamb, lion

__all__ = ["adagrad", "adam", "lamb", "lion"]


def __getattr__(name: str) -> Any:
    raise module_getattr_error(__name__, name)  # transformer, sparse_attention: instead
