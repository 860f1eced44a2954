"""``deepspeed.ops.adam.cpu_adam``: DeepSpeed's module path of
:class:`~dsrun.ops.adam.DeepSpeedCPUAdam` (the same class)."""

from __future__ import annotations

from dsrun.ops.adam import DeepSpeedCPUAdam

__all__ = ["DeepSpeedCPUAdam"]
