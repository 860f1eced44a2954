"""``deepspeed.ops.adam.fused_adam``: DeepSpeed's module path of
:class:`~dsrun.ops.adam.FusedAdam` (the same class)."""

from __future__ import annotations

from dsrun.ops.adam import FusedAdam

__all__ = ["FusedAdam"]
