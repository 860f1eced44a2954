"""DeepSpeed's ``deepspeed.runtime.zero.offload_config`` module path: its
:class:`OffloadDeviceEnum` (dsrun's offload sections are
``OffloadOptimizerConfig``/``OffloadParamConfig`` in
:mod:`dsrun.runtime.config_sections`; ``nvme`` is refused there)."""

from __future__ import annotations

from enum import Enum

__all__ = ["OffloadDeviceEnum"]


class OffloadDeviceEnum(str, Enum):
    none = "none"
    cpu = "cpu"
    nvme = "nvme"
