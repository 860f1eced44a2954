"""``deepspeed.runtime.config.DeepSpeedConfig`` (dsrun.runtime.ds_config):
the attributes DeepSpeed 0.19.8's class gives for the same configs (values
taken from DeepSpeed 0.19.8 on CPU), resolved by dsrun's config rules."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

import dsrun
from dsrun.errors import DsrunConfigError
from dsrun.monitor.config import DeepSpeedMonitorConfig
from dsrun.runtime.config import DeepSpeedConfig

NAMES = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
         "zero_optimization_stage", "zero_enabled", "gradient_clipping", "steps_per_print",
         "wall_clock_breakdown", "fp16_enabled", "bfloat16_enabled")

CASES = [
    ({"train_batch_size": 8}, (8, 8, 1, 0, False, 1.0, None, False, False, False)),
    ({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 3,
      "zero_optimization": {"stage": 2}, "bf16": {"enabled": True}, "gradient_clipping": 0.5,
      "steps_per_print": 5, "flops_profiler": {"enabled": True}},
     (6, 2, 3, 2, True, 0.5, 5, True, False, True)),
    ({"train_batch_size": 16, "train_micro_batch_size_per_gpu": 4, "zero_optimization": True,
      "fp16": {"enabled": True}}, (16, 4, 4, 1, True, 1.0, None, False, True, False)),
    ({"train_batch_size": 12, "gradient_accumulation_steps": 3, "wall_clock_breakdown": True},
     (12, 4, 3, 0, False, 1.0, None, True, False, False)),
]


def values(config: DeepSpeedConfig) -> tuple[Any, ...]:
    return tuple(getattr(config, name) for name in NAMES)


@pytest.mark.parametrize(("raw", "expected"), CASES)
def test_attributes_are_deepspeeds_without_a_process_group(raw: dict, expected: tuple) -> None:
    config = DeepSpeedConfig(raw)
    assert values(config) == expected
    assert (config.world_size, config.global_rank) == (1, 0)
    assert config.float16_config.enabled == expected[-2]
    assert config.bfloat16_config.enabled == expected[-1]


def test_a_json_path_gives_the_monitor_sections_monitormaster_takes(tmp_path: Path) -> None:
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps({
        "train_batch_size": 8,
        "csv_monitor": {"enabled": True, "output_path": "o/", "job_name": "j"}}))
    config = DeepSpeedConfig(str(path))
    monitor = config.monitor_config
    assert isinstance(monitor, DeepSpeedMonitorConfig) and monitor.enabled
    assert (monitor.csv_monitor.enabled, monitor.csv_monitor.output_path,
            monitor.csv_monitor.job_name) == (True, "o/", "j")
    assert not monitor.tensorboard.enabled and monitor.tensorboard.job_name == "DeepSpeedJobName"
    assert dsrun.DeepSpeedConfig is DeepSpeedConfig


class DataParallel:
    def get_data_parallel_world_size(self) -> int:
        return 2


@pytest.mark.parametrize(("raw", "expected"), [
    ({"train_batch_size": 16, "train_micro_batch_size_per_gpu": 4}, (16, 4, 2)),
    ({"train_batch_size": 16, "gradient_accumulation_steps": 2}, (16, 4, 2)),
    ({"train_micro_batch_size_per_gpu": 3}, (6, 3, 1)),
    ({"train_batch_size": 16}, (16, 8, 1)),
])
def test_incomplete_batch_keys_are_solved_for_the_mpus_data_parallel_size(
        solo: None, raw: dict, expected: tuple) -> None:
    config = DeepSpeedConfig(raw, mpu=DataParallel())
    assert config.world_size == 2
    assert values(config)[:3] == expected


def test_a_batch_that_does_not_divide_is_a_config_error(solo: None) -> None:
    with pytest.raises(DsrunConfigError, match="16"):
        DeepSpeedConfig({"train_batch_size": 16, "train_micro_batch_size_per_gpu": 3},
                        mpu=DataParallel())
    with pytest.raises(DsrunConfigError, match="train_batch_siez"):
        DeepSpeedConfig({"train_batch_siez": 16})
