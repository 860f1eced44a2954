"""DeepSpeed's ``deepspeed.monitor.tensorboard``: :class:`TensorBoardMonitor`,
dsrun's TensorBoard writer under ``output_path/job_name``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from dsrun.monitor._base import WriterMonitor
from dsrun.monitor.config import SOURCE
from dsrun.runtime.monitor.writers import TensorBoardWriter, make_log_dir

__all__ = ["TensorBoardMonitor"]


class TensorBoardMonitor(WriterMonitor):
    section = "tensorboard"

    def __init__(self, tensorboard_config: Any) -> None:
        self.output_path = tensorboard_config.output_path
        self.job_name = tensorboard_config.job_name
        super().__init__(tensorboard_config, self._make)

    def _make(self) -> TensorBoardWriter:
        log_dir = make_log_dir(self.output_path, self.job_name, self.section, SOURCE)
        return TensorBoardWriter(log_dir, SOURCE)

    @property
    def summary_writer(self) -> Any:
        """``torch.utils.tensorboard``'s ``SummaryWriter`` (rank 0), else None."""
        return getattr(self.writer, "summary_writer", None)

    def write_events(self, event_list: Sequence[Any], flush: bool = True) -> None:
        """Write and flush (dsrun's writer flushes after every write)."""
        super().write_events(event_list)

    def flush(self) -> None:
        if self.summary_writer is not None:
            self.summary_writer.flush()
