"""DeepSpeed's ``deepspeed.monitor.wandb``: :class:`WandbMonitor`, dsrun's
wandb writer (``wandb.init(project=, group=, entity=team)`` on rank 0)."""

from __future__ import annotations

from typing import Any, Optional

from dsrun.monitor._base import WriterMonitor
from dsrun.monitor.config import SOURCE
from dsrun.runtime.monitor.writers import WandbWriter

__all__ = ["WandbMonitor"]


class WandbMonitor(WriterMonitor):
    section = "wandb"

    def __init__(self, wandb_config: Any) -> None:
        self.group = wandb_config.group
        self.team = wandb_config.team
        self.project = wandb_config.project
        super().__init__(wandb_config, self._make)

    def _make(self) -> WandbWriter:
        return WandbWriter(self.project, self.group, self.team, SOURCE)

    def log(self, data: dict[str, Any], step: Optional[int] = None,
            commit: Optional[bool] = None) -> Any:
        """``wandb.log`` on the monitor's run (rank 0 when enabled; elsewhere nothing)."""
        run = getattr(self.writer, "run", None)
        return None if run is None else run.log(data, step=step, commit=commit)
