"""The base classes of :mod:`dsrun.monitor`'s backends: DeepSpeed's
abstract ``Monitor`` and one backend over one dsrun writer."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any, Callable, Optional

from dsrun.monitor.config import SOURCE
from dsrun.runtime.monitor.master import check_events
from dsrun.runtime.monitor.writers import Writer, check_package


def global_rank() -> int:
    """This process's global rank (0 without a process group or launcher)."""
    from dsrun import comm

    return comm.get_rank()


class Monitor(ABC):
    """DeepSpeed's monitor interface: built from a config, ``write_events``
    takes ``[(name, value, step), ...]``."""

    @abstractmethod
    def __init__(self, monitor_config: Any) -> None:
        self.monitor_config = monitor_config

    @abstractmethod
    def write_events(self, event_list: Sequence[Any]) -> None: ...


class WriterMonitor(Monitor):
    """One backend: ``make()`` builds its writer on rank 0 when the section
    is enabled. An enabled section whose package is missing is the same
    :class:`~dsrun.errors.DsrunConfigError` on every rank."""

    section = ""

    def __init__(self, section_config: Any, make: Callable[[], Writer]) -> None:
        super().__init__(section_config)
        self.enabled = bool(section_config.enabled)
        self.writer: Optional[Writer] = None
        if not self.enabled:
            return
        check_package(self.section, SOURCE)
        if global_rank() == 0:
            self.writer = make()

    def write_events(self, event_list: Sequence[Any]) -> None:
        """Write the events (rank 0; checked first, a bad one raises)."""
        if self.enabled:
            checked = check_events(event_list)
            if self.writer is not None:
                self.writer.write(checked)

    def close(self) -> None:
        writer, self.writer = self.writer, None
        if writer is not None:
            writer.close()
