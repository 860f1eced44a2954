"""DeepSpeed's ``deepspeed.monitor.comet``: :class:`CometMonitor`, dsrun's
Comet writer (an experiment on rank 0; each event name logged again once
``samples_log_interval`` steps have passed)."""

from __future__ import annotations

from typing import Any

from dsrun.monitor._base import WriterMonitor
from dsrun.monitor.config import SOURCE
from dsrun.runtime.monitor.writers import CometWriter

__all__ = ["CometMonitor"]


class CometMonitor(WriterMonitor):
    section = "comet"

    def __init__(self, comet_config: Any) -> None:
        self._samples_log_interval = comet_config.samples_log_interval
        super().__init__(comet_config, lambda: CometWriter(comet_config, SOURCE))

    @property
    def experiment(self) -> Any:
        """The Comet experiment (rank 0), else None."""
        return getattr(self.writer, "experiment", None)

    @property
    def samples_log_interval(self) -> int:
        return self._samples_log_interval
