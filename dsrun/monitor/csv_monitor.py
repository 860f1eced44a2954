"""DeepSpeed's ``deepspeed.monitor.csv_monitor``: :class:`csvMonitor`,
dsrun's CSV writer (DeepSpeed's file layout) under ``output_path/job_name``."""

from __future__ import annotations

from typing import Any, Optional

from dsrun.monitor._base import WriterMonitor
from dsrun.monitor.config import SOURCE
from dsrun.runtime.monitor.writers import CsvWriter, make_log_dir

__all__ = ["csvMonitor"]


class csvMonitor(WriterMonitor):  # noqa: N801 - DeepSpeed's class name
    section = "csv_monitor"

    def __init__(self, csv_config: Any) -> None:
        self.output_path = csv_config.output_path
        self.job_name = csv_config.job_name
        self.log_dir: Optional[str] = None  # rank 0's directory once built
        super().__init__(csv_config, self._make)

    def _make(self) -> CsvWriter:
        self.log_dir = make_log_dir(self.output_path, self.job_name, self.section, SOURCE)
        return CsvWriter(self.log_dir)
