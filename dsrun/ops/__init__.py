"""``dsrun.ops``: what DeepSpeed scripts import from ``deepspeed.ops``.

Only the optimizers scripts build themselves are here
(``from deepspeed.ops.adam import FusedAdam, DeepSpeedCPUAdam``, and
``deepspeed.ops.lion``'s ``FusedLion``, ``DeepSpeedCPULion``); they run on
torch's Adam and dsrun's Lion, so nothing is compiled (:mod:`dsrun.ops.adam`,
:mod:`dsrun.ops.lion`). Importing
this package imports torch (``import dsrun`` alone does not).
"""

from __future__ import annotations

from dsrun.ops import adam, lion

__all__ = ["adam", "lion"]
