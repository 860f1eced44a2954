"""DeepSpeed's engine accessors for ZeRO-Offload, a base of
:class:`~dsrun.runtime.engine_info.EngineInfo`.

As in DeepSpeed 0.19.8, :meth:`~OffloadAccessors.zero_offload_optimizer` and
:meth:`~OffloadAccessors.zero_offload_param` return the config section itself
(its ``.device``, ``.pin_memory``, ``.ratio``, ...) or None where the config
has none - a section whose ``device`` is ``"none"`` is returned too - so the
usual ``engine.zero_offload_optimizer() is not None and ...device == "cpu"``
checks work; the other accessors answer with what those sections say.
"""

from __future__ import annotations

from typing import Optional

from dsrun.runtime.config import DsrunConfig
from dsrun.runtime.config_sections import OffloadOptimizerConfig, OffloadParamConfig


class OffloadAccessors:
    """The ``zero_*offload*`` accessors (module docstring)."""

    config: DsrunConfig

    def zero_offload_optimizer(self) -> Optional[OffloadOptimizerConfig]:
        """The ``zero_optimization.offload_optimizer`` section, else None."""
        return self.config.zero_optimization.offload_optimizer

    def zero_offload_param(self) -> Optional[OffloadParamConfig]:
        """The ``zero_optimization.offload_param`` section, else None."""
        return self.config.zero_optimization.offload_param

    def zero_use_cpu_optimizer(self) -> bool:
        """The optimizer steps in host memory: ``offload_optimizer.device``
        is "cpu" (or "nvme", which dsrun refuses at the stages that use it)."""
        offload = self.zero_offload_optimizer()
        return offload is not None and offload.device in ("cpu", "nvme")

    def zero_cpu_offload(self) -> bool:
        """``offload_optimizer.device`` is "cpu"."""
        offload = self.zero_offload_optimizer()
        return offload is not None and offload.device == "cpu"

    def zero_partial_offload(self) -> float:
        """``offload_optimizer.ratio`` (1.0 without the section). dsrun
        offloads everything whatever it says (the engine warns below 1)."""
        offload = self.zero_offload_optimizer()
        return 1.0 if offload is None else offload.ratio
