"""DeepSpeed's ``deepspeed.monitor`` module paths, over dsrun's monitors
(:mod:`dsrun.runtime.monitor`: the writers, the fan-out, the config
sections), for scripts that build a monitor themselves - DeepSpeed's
"Custom Monitoring" tutorial::

    from deepspeed.monitor.config import get_monitor_config
    from deepspeed.monitor.monitor import MonitorMaster
    monitor = MonitorMaster(get_monitor_config(ds_config))
    monitor.write_events([("Train/custom", value, step)])

* :mod:`.config` - ``get_monitor_config``, ``DeepSpeedMonitorConfig`` and
  the section classes (dsrun's, under DeepSpeed's names);
* :mod:`.monitor` - the ``Monitor`` base class and ``MonitorMaster``;
* :mod:`.csv_monitor`, :mod:`.tensorboard`, :mod:`.wandb`, :mod:`.comet` -
  one backend each (``csvMonitor``, ``TensorBoardMonitor``,
  ``WandbMonitor``, ``CometMonitor``), each holding one dsrun writer.
* :mod:`.utils` - ``check_tb_availability`` and the other package checks.

An engine's ``engine.monitor`` is a ``MonitorMaster`` too
(:class:`dsrun.runtime.monitor.training.EngineMonitor`), whose writers
come from the engine's config.

As in DeepSpeed, only global rank 0 (or a process without a process
group) writes; on other ranks ``write_events`` does nothing.
"""
