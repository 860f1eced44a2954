"""What a script's own init_process_group call asks for is applied or warned
about, never dropped (runtime/dist.py); the group calls are stubbed."""

from __future__ import annotations

import datetime
import logging

import pytest
import torch

from dsrun.errors import DsrunError
from dsrun.runtime import dist as rdist
from dsrun.runtime.env import DistEnv


class FakeWorld:
    def __init__(self, backend: str = "gloo") -> None:
        self.backend = backend
        self.alive = True
        self.timeouts: list[datetime.timedelta] = []
        self.inits: list[dict] = []


#: dist.get_backend_config() of groups made with these backends (torch 2.13)
CONFIGS = {"gloo": "cpu:gloo,cuda:gloo", "nccl": "cuda:nccl", "mpi": "cpu:mpi,cuda:mpi"}


@pytest.fixture
def world(monkeypatch):
    w = FakeWorld()
    d = rdist.dist
    monkeypatch.setattr(d, "is_initialized", lambda: w.alive)
    monkeypatch.setattr(d, "get_backend", lambda group=None: w.backend)
    monkeypatch.setattr(d, "get_backend_config", lambda group=None: CONFIGS[w.backend])
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


def test_other_backend_recreates_the_group(world, monkeypatch):
    monkeypatch.setattr(rdist.dist, "is_mpi_available", lambda: True)  # a torch built with MPI
    rdist.tolerant_init_process_group("mpi")
    assert not world.alive and world.inits[0]["backend"] == "mpi"


def test_mpi_without_mpi_in_torch_is_refused_and_the_group_kept(world, monkeypatch):
    monkeypatch.setattr(rdist.dist, "is_mpi_available", lambda: False)  # pip's wheels
    with pytest.raises(DsrunError) as info:
        rdist.tolerant_init_process_group(backend="mpi")
    assert str(info.value).startswith(
        "torch.distributed.init_process_group(backend='mpi') asked for the MPI backend, but "
        f"this torch ({torch.__version__}) was built without MPI "
        "(torch.distributed.is_mpi_available() is False")
    assert world.alive and world.inits == []
    for spec in ("MPI", "cpu:mpi,cuda:nccl"):
        with pytest.raises(DsrunError, match="built without MPI"):
            rdist.check_backend(spec, CPU_RANK, "x")
    monkeypatch.setattr(rdist.dist, "is_mpi_available", lambda: True)
    rdist.check_backend("mpi", CPU_RANK, "x")  # fine


def test_wrong_rank_or_world_size_is_warned_about(world, caplog):
    with caplog.at_level(logging.WARNING, logger="dsrun.runtime"):
        rdist.tolerant_init_process_group("gloo", rank=1, world_size=2)
        assert caplog.records == []
        rdist.tolerant_init_process_group("gloo", rank=0, world_size=4)
    text = caplog.text
    assert "init_process_group(rank=0) ignored: this rank's rank is 1" in text
    assert "init_process_group(world_size=4) ignored" in text


REAL_INIT_DISTRIBUTED = rdist.init_distributed  # the world fixture stubs it
CPU_RANK = DistEnv(rank=1, world_size=2, local_rank=1, local_world_size=2, accelerator="cpu")


def test_check_backend_refuses_nccl_on_a_cpu_rank(monkeypatch):
    with pytest.raises(DsrunError) as info:
        rdist.check_backend("NCCL", CPU_RANK, "torch.distributed.init_process_group(...)")
    text = str(info.value)
    assert text.startswith("torch.distributed.init_process_group(...) asked for the NCCL "
                           "backend, but NCCL needs GPUs and rank 1 is a CPU rank (dsrun --cpu")
    assert "gloo" in text and "Leave the backend out" in text
    rdist.check_backend("gloo", CPU_RANK, "x")  # fine
    no_cuda = DistEnv(rank=0, world_size=1)
    monkeypatch.setattr(rdist.torch.cuda, "is_available", lambda: False)
    with pytest.raises(DsrunError, match=r"torch sees no CUDA device \(torch.cuda.is_available"):
        rdist.check_backend("nccl", no_cuda, "x")
    monkeypatch.setattr(rdist.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(rdist.torch.cuda, "device_count", lambda: 1)
    rdist.check_backend("nccl", no_cuda, "x")  # a GPU rank: fine
    with pytest.raises(DsrunError):
        rdist.check_backend("nccl", CPU_RANK, "x")  # dsrun --cpu on a GPU host


def test_nccl_on_a_cpu_rank_is_refused_before_the_group_is_touched(world, monkeypatch):
    monkeypatch.setattr(rdist.DistEnv, "detect", classmethod(lambda cls, **kw: CPU_RANK))
    with pytest.raises(DsrunError, match=r"init_process_group\(backend='nccl'\) asked for the "
                                         "NCCL backend"):
        rdist.tolerant_init_process_group(backend="nccl")
    assert world.alive and world.inits == []  # the gloo group is kept, working


def test_init_distributed_keeps_an_existing_group_as_deepspeed(world, monkeypatch, caplog):
    """deepspeed.init_distributed(dist_backend="nccl") with a group up keeps
    it (DeepSpeed wraps an existing group); rank 0 says so."""
    monkeypatch.setattr(rdist.dist, "get_rank", lambda group=None: 0)
    with caplog.at_level(logging.INFO, logger="dsrun.runtime"):
        REAL_INIT_DISTRIBUTED(dist_backend="nccl")
        REAL_INIT_DISTRIBUTED()  # nothing asked: nothing said
    assert world.alive and world.inits == []
    assert [r.getMessage() for r in caplog.records] == [
        "init_distributed(dist_backend='nccl'): the process group exists already (backend "
        "gloo) and is kept, as DeepSpeed keeps an existing group"]


def test_init_distributed_sets_its_timeout_on_the_existing_group(world):
    """Under dsrun the group exists before the script: deepspeed.init_distributed
    (timeout=...) sets that timeout on it, as DeepSpeed would have made the
    group with it (it used to be dropped)."""
    REAL_INIT_DISTRIBUTED(dist_backend="gloo", timeout=datetime.timedelta(seconds=3))
    assert world.timeouts == [datetime.timedelta(seconds=3)] and world.alive
    REAL_INIT_DISTRIBUTED()  # no timeout given: the group's stays
    assert world.timeouts == [datetime.timedelta(seconds=3)]


@pytest.mark.parametrize(("value", "minutes"), [(None, None), ("", None), ("1", 1),
                                                (" 45 ", 45)])
def test_deepspeed_timeout_is_whole_minutes(value, minutes):
    environ = {} if value is None else {"DEEPSPEED_TIMEOUT": value}
    expected = None if minutes is None else datetime.timedelta(minutes=minutes)
    assert rdist.timeout_from_env(environ) == expected


@pytest.mark.parametrize("value", ["0", "-5", "1.5", "ten"])
def test_a_bad_deepspeed_timeout_is_named(value):
    with pytest.raises(DsrunError, match=rf"DEEPSPEED_TIMEOUT='{value}': the process group's "
                                         "timeout is a whole number of minutes"):
        rdist.timeout_from_env({"DEEPSPEED_TIMEOUT": value})


def test_a_new_group_gets_deepspeed_timeout(monkeypatch):
    """init_distributed() without timeout= makes the group with
    DEEPSPEED_TIMEOUT's (the bootstrap's call too); an explicit one wins."""
    made: list[dict] = []
    monkeypatch.setattr(rdist.dist, "is_initialized", lambda: False)
    monkeypatch.setattr(rdist, "_original_init", lambda **kw: made.append(kw))
    monkeypatch.setattr(rdist.atexit, "register", lambda fn: fn)
    monkeypatch.setattr(rdist, "_owned_by_dsrun", False)
    solo = DistEnv(rank=0, world_size=1, accelerator="cpu")
    monkeypatch.setenv("DEEPSPEED_TIMEOUT", "2")
    REAL_INIT_DISTRIBUTED(env=solo)
    REAL_INIT_DISTRIBUTED(env=solo, timeout=datetime.timedelta(seconds=5))
    monkeypatch.delenv("DEEPSPEED_TIMEOUT")
    REAL_INIT_DISTRIBUTED(env=solo)
    assert [m.get("timeout") for m in made] == [datetime.timedelta(minutes=2),
                                                datetime.timedelta(seconds=5), None]
