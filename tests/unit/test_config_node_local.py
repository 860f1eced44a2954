"""``"checkpoint": {"use_node_local_storage": true}``: DeepSpeed writes each
node's files to its own disk; dsrun's checkpoint is one directory every
rank shares, so the key is warned about when the config is read (README,
the ``checkpoint`` config section)."""

from __future__ import annotations

import logging

from dsrun.runtime.config import resolve


def test_use_node_local_storage_is_warned_about_at_config_time(caplog):
    with caplog.at_level(logging.WARNING, logger="dsrun.runtime.config"):
        config = resolve({"train_micro_batch_size_per_gpu": 1,
                          "checkpoint": {"use_node_local_storage": True}},
                         dp_size=1, dp_source="test")
    assert config.checkpoint.use_node_local_storage
    warned = [r.getMessage() for r in caplog.records if "use_node_local_storage" in r.getMessage()]
    assert len(warned) == 1, warned
    assert "is not implemented by dsrun" in warned[0]
    assert "need a directory on a file system every host shares" in warned[0]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="dsrun.runtime.config"):
        resolve({"train_micro_batch_size_per_gpu": 1,
                 "checkpoint": {"use_node_local_storage": False}}, dp_size=1, dp_source="test")
    assert not [r for r in caplog.records if "use_node_local_storage" in r.getMessage()]
