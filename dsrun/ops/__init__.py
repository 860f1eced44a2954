"""``dsrun.ops``: what DeepSpeed scripts import from ``deepspeed.ops``.

Only the optimizers scripts build themselves are here
(``from deepspeed.ops.adam import FusedAdam, DeepSpeedCPUAdam``); they run
on torch's Adam, so nothing is compiled (:mod:`dsrun.ops.adam`). Importing
this package imports torch (``import dsrun`` alone does not).
"""

from __future__ import annotations

from dsrun.ops import adam

__all__ = ["adam"]
