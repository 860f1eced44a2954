"""DeepSpeed's ``deepspeed.monitor.monitor``: the ``Monitor`` base class and
:class:`MonitorMaster`, dsrun's fan-out (:class:`dsrun.runtime.monitor.master.Monitor`:
rank 0 writes, events are checked, a writer that fails is warned about and
dropped) over DeepSpeed's backend objects."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Callable, Optional

from dsrun.monitor._base import Monitor, global_rank
from dsrun.monitor.comet import CometMonitor
from dsrun.monitor.config import DeepSpeedMonitorConfig, get_monitor_config
from dsrun.monitor.csv_monitor import csvMonitor
from dsrun.monitor.tensorboard import TensorBoardMonitor
from dsrun.monitor.wandb import WandbMonitor
from dsrun.runtime.monitor import master
from dsrun.runtime.monitor.writers import Writer

__all__ = ["CometMonitor", "Monitor", "MonitorMaster", "TensorBoardMonitor", "WandbMonitor",
           "csvMonitor"]


class MonitorMaster(master.Monitor, Monitor):
    """Every enabled backend of ``monitor_config`` (a
    :class:`~dsrun.monitor.config.DeepSpeedMonitorConfig`, or a config
    dict), built on global rank 0 in DeepSpeed's order; ``write_events``
    goes to each of them there and is a no-op on other ranks.
    ``tb_monitor``, ``wandb_monitor``, ``csv_monitor`` and ``comet_monitor``
    are the backends (None where disabled or not rank 0).

    An engine's ``engine.monitor`` is one too: its subclass
    :class:`~dsrun.runtime.monitor.training.EngineMonitor` starts through
    :meth:`_start` with the writers of the engine's config instead."""

    def __init__(self, monitor_config: Any) -> None:
        if isinstance(monitor_config, Mapping):
            monitor_config = get_monitor_config(monitor_config)
        if not isinstance(monitor_config, DeepSpeedMonitorConfig):
            raise TypeError("MonitorMaster takes a DeepSpeedMonitorConfig (get_monitor_config("
                            f"ds_config)) or a config dict, not {type(monitor_config).__name__}")
        self.tb_monitor: Optional[TensorBoardMonitor] = None
        self.wandb_monitor: Optional[WandbMonitor] = None
        self.csv_monitor: Optional[csvMonitor] = None
        self.comet_monitor: Optional[CometMonitor] = None
        self._start(monitor_config, global_rank(), self._build)

    def _start(self, config: Any, rank: int, build: Callable[[Any], list[Writer]]) -> None:
        """Keep ``config`` as DeepSpeed's ``monitor_config`` and start the
        fan-out: on ``rank`` 0, ``build(config)`` makes the writers."""
        Monitor.__init__(self, config)
        master.Monitor.__init__(self, config, rank, build=build)

    def _build(self, config: DeepSpeedMonitorConfig) -> list[Writer]:
        backends: list[Any] = []
        try:
            if config.tensorboard.enabled:
                self.tb_monitor = TensorBoardMonitor(config.tensorboard)
                backends.append(self.tb_monitor)
            if config.wandb.enabled:
                self.wandb_monitor = WandbMonitor(config.wandb)
                backends.append(self.wandb_monitor)
            if config.csv_monitor.enabled:
                self.csv_monitor = csvMonitor(config.csv_monitor)
                backends.append(self.csv_monitor)
            if config.comet.enabled:
                self.comet_monitor = CometMonitor(config.comet)
                backends.append(self.comet_monitor)
        except BaseException:
            for backend in backends:
                backend.close()
            raise
        return [b.writer for b in backends if b.writer is not None]
