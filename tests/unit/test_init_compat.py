"""What a script's own init_process_group call asks for is applied or warned
about, never dropped (runtime/dist.py); the group calls are stubbed."""

from __future__ import annotations

import datetime
import logging

import pytest
import torch

from dsrun.runtime import dist as rdist


class FakeWorld:
    def __init__(self, backend: str = "gloo") -> None:
        self.backend = backend
        self.alive = True
        self.timeouts: list[datetime.timedelta] = []
        self.inits: list[dict] = []


@pytest.fixture
def world(monkeypatch):
    w = FakeWorld()
    d = rdist.dist
    monkeypatch.setattr(d, "is_initialized", lambda: w.alive)
    monkeypatch.setattr(d, "get_backend", lambda group=None: w.backend)
    monkeypatch.setattr(d, "get_rank", lambda group=None: 1)
    monkeypatch.setattr(d, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(d, "destroy_process_group", lambda group=None: setattr(w, "alive",
                                                                               False))
    monkeypatch.setattr(d.distributed_c10d, "_set_pg_timeout",
                        lambda timeout, group=None: w.timeouts.append(timeout))
    monkeypatch.setattr(rdist, "init_distributed", lambda **kw: w.inits.append(kw))
    monkeypatch.setattr(rdist, "_owned_by_dsrun", True)
    return w


def test_timeout_is_set_on_the_existing_group(world):
    rdist.tolerant_init_process_group("gloo", timeout=datetime.timedelta(seconds=7))
    assert world.timeouts == [datetime.timedelta(seconds=7)] and world.alive
    rdist.tolerant_init_process_group("gloo", None, datetime.timedelta(seconds=9))  # positional
    assert world.timeouts[-1] == datetime.timedelta(seconds=9)


def test_device_id_other_than_the_ranks_device_recreates_the_group(world):
    rdist.tolerant_init_process_group(backend="gloo", device_id=torch.device("cpu"))
    assert world.alive and world.inits == []  # the device it has: nothing to change
    rdist.tolerant_init_process_group(backend="gloo", device_id=torch.device("meta"),
                                      timeout=datetime.timedelta(seconds=5))
    assert not world.alive
    assert world.inits == [{"backend": "gloo", "timeout": datetime.timedelta(seconds=5),
                            "device_id": torch.device("meta"), "pg_options": None}]


def test_other_backend_recreates_the_group(world):
    rdist.tolerant_init_process_group("mpi")
    assert not world.alive and world.inits[0]["backend"] == "mpi"


def test_wrong_rank_or_world_size_is_warned_about(world, caplog):
    with caplog.at_level(logging.WARNING, logger="dsrun.runtime"):
        rdist.tolerant_init_process_group("gloo", rank=1, world_size=2)
        assert caplog.records == []
        rdist.tolerant_init_process_group("gloo", rank=0, world_size=4)
    text = caplog.text
    assert "init_process_group(rank=0) ignored: this rank's rank is 1" in text
    assert "init_process_group(world_size=4) ignored" in text
