"""``engine.data_efficiency_enabled()`` answers the section's flag, as
DeepSpeed's engine does, while dsrun still does not act on the section.
A world-size-1 gloo group (HashStore: no ports)."""

from __future__ import annotations

import pytest
import torch

import dsrun

LAUNCHER_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                "MASTER_PORT", "DSRUN_CONFIG")


@pytest.mark.parametrize("section, expected", [
    (None, False), ({"enabled": False}, False), ({"enabled": True}, True),
    ({"enabled": True, "data_sampling": {"enabled": False}}, True),
])
def test_data_efficiency_enabled_reports_the_section(
        solo: None, monkeypatch: pytest.MonkeyPatch, section: dict, expected: bool) -> None:
    for key in LAUNCHER_ENV:
        monkeypatch.delenv(key, raising=False)
    config = {"train_batch_size": 1, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    if section is not None:
        config["data_efficiency"] = section
    engine, *_ = dsrun.initialize(model=torch.nn.Linear(2, 1), config=config)
    assert engine.data_efficiency_enabled() is expected
    assert engine.curriculum_learning_enabled() is False
