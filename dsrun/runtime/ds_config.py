"""DeepSpeed's ``deepspeed.runtime.config.DeepSpeedConfig`` over dsrun's
config resolution.

Scripts build it themselves, most often for DeepSpeed's "Custom Monitoring"
tutorial::

    from deepspeed.runtime.config import DeepSpeedConfig
    ds_config = DeepSpeedConfig("ds_config.json")
    monitor = MonitorMaster(ds_config.monitor_config)

The config (a JSON path or a dict) goes through
:func:`dsrun.runtime.config.resolve`, with its strict checks, for the
data-parallel size of the process group when one is up
(:func:`_data_parallel_size`). Under dsrun's launcher the group is up
before the script runs, so a config built at the top of a script uses the
real world size, where DeepSpeed, before its ``init_distributed``, uses 1
(with ``train_batch_size`` alone the micro-batch differs). The attributes
are DeepSpeed 0.19.8's names and values. Not every attribute of
DeepSpeed's class is here: the monitor sections, the batch triple,
precision, ZeRO stage, clipping, ``steps_per_print`` and
``wall_clock_breakdown``; the whole resolved config is ``dsrun_config``.
Nothing here imports torch: a process group can only be up where a script
imported ``torch.distributed`` already.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any, Optional

from dsrun.monitor.config import DeepSpeedMonitorConfig

if TYPE_CHECKING:
    from dsrun.runtime.config import ConfigInput, DsrunConfig

__all__ = ["DeepSpeedConfig"]


def _data_parallel_size(mpu: Any, mesh_device: Any) -> tuple[int, int, str]:
    """(global rank, data-parallel size, where the size came from), as
    DeepSpeed's ``DeepSpeedConfig`` takes them: rank 0 and size 1 without a
    process group, else the ``mpu``'s data-parallel size, the
    ``mesh_device``'s ``data_parallel`` group, or the world size."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return 0, 1, "DeepSpeedConfig without a process group (world size 1, as DeepSpeed)"
    rank = dist.get_rank()
    if mpu is not None and hasattr(mpu, "get_data_parallel_world_size"):
        return rank, int(mpu.get_data_parallel_world_size()), \
            "DeepSpeedConfig(mpu=...): mpu.get_data_parallel_world_size()"
    if mpu is not None:  # Ulysses sequence parallelism: DeepSpeed divides the world
        size = dist.get_world_size() // int(mpu.get_sequence_parallel_world_size())
        return rank, size, ("DeepSpeedConfig(mpu=...): world size / "
                            "mpu.get_sequence_parallel_world_size()")
    if mesh_device is not None:
        group = mesh_device.get_group(mesh_dim="data_parallel")
        return rank, dist.get_world_size(group), \
            "DeepSpeedConfig(mesh_device=...): its data_parallel group"
    return rank, dist.get_world_size(), "DeepSpeedConfig: the process group's world size"


class DeepSpeedConfig:
    """A DeepSpeed config (JSON path or dict) resolved as ``initialize``
    resolves it (module docstring). An invalid config is a
    :class:`~dsrun.errors.DsrunConfigError` naming the key, as in
    ``initialize``; DeepSpeed's base64-encoded config strings are not read.
    """

    def __init__(self, config: ConfigInput, mpu: Any = None, mesh_device: Any = None) -> None:
        # here, not at the top: dsrun.runtime.config re-exports this class
        # from its last line, and either module may be imported first
        from dsrun.runtime.config import load_config, resolve

        raw, _ = load_config(config)
        self._param_dict = raw
        self.global_rank, self.world_size, source = _data_parallel_size(mpu, mesh_device)
        resolved = resolve(config, dp_size=self.world_size, dp_source=source,
                           optimizer_given=False)
        self.dsrun_config: DsrunConfig = resolved
        self.train_batch_size = resolved.train_batch_size
        self.train_micro_batch_size_per_gpu = resolved.train_micro_batch_size_per_gpu
        self.gradient_accumulation_steps = resolved.gradient_accumulation_steps
        # DeepSpeed's default is None (the engine then never prints); dsrun
        # resolves the absent key to its own default
        self.steps_per_print: Optional[int] = \
            resolved.steps_per_print if "steps_per_print" in raw else None
        self.zero_config = resolved.zero_optimization
        self.zero_optimization_stage = resolved.zero_optimization.stage
        self.zero_enabled = self.zero_optimization_stage > 0
        self.float16_config = resolved.fp16
        self.bfloat16_config = resolved.bf16
        # the names of DeepSpeed before 0.14, which scripts still read
        self.fp16_enabled = resolved.fp16.enabled
        self.bfloat16_enabled = resolved.bf16.enabled
        self.gradient_clipping = resolved.gradient_clipping
        # DeepSpeed turns the breakdown on for the flops profiler too
        self.wall_clock_breakdown = resolved.wall_clock_breakdown \
            or resolved.flops_profiler.enabled
        self.monitor_config = DeepSpeedMonitorConfig(
            tensorboard=resolved.tensorboard, comet=resolved.comet, wandb=resolved.wandb,
            csv_monitor=resolved.csv_monitor, source=resolved.source)

    def __repr__(self) -> str:
        return (f"DeepSpeedConfig({self.dsrun_config.source}: train batch "
                f"{self.train_batch_size}, ZeRO stage {self.zero_optimization_stage})")
