"""``dsrun.comm`` (DeepSpeed's ``deepspeed.comm``) on a one-rank gloo group
in this process: every collective does what torch's does, takes
DeepSpeed's extra keywords, and is logged when the logger is on. The
multi-rank side (the engine's own collectives in the log, the straggler
analysis across ranks) is the ``comms_logger`` case of
``tests/dist/test_engine_dist.py``."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from dsrun import comm
from dsrun.runtime.commlog import LOGGER

pytestmark = pytest.mark.dist


@pytest.fixture
def logger() -> Iterator[None]:
    """The process-wide logger, on and empty for the test, off and empty after."""
    LOGGER.reset()
    LOGGER.configure(enabled=True, prof_all=True, prof_ops=[], verbose=False, debug=False)
    try:
        yield
    finally:
        LOGGER.configure(enabled=False, prof_all=True, prof_ops=[], verbose=False, debug=False)
        LOGGER.reset()


def counts() -> dict[str, dict[int, int]]:
    return {name: {size: row["count"] for size, row in by_size.items()}
            for name, by_size in LOGGER.summary().items()}


def test_collectives_compute_and_are_logged(solo: None, logger: None) -> None:
    t = torch.arange(6, dtype=torch.float32)
    comm.all_reduce(t, prof=True, log_name="grads", debug="x")  # DeepSpeed's keywords
    assert torch.equal(t, torch.arange(6, dtype=torch.float32))  # world 1: a sum of one
    out = torch.empty(6)
    comm.all_gather_into_tensor(out, t)
    assert torch.equal(out, t)
    shard = torch.empty(6)
    comm.reduce_scatter_tensor(shard, t)
    assert torch.equal(shard, t)
    comm.allgather_fn(out, t)
    comm.reduce_scatter_fn(shard, t)
    comm.broadcast(t, src=0)
    comm.reduce(t, dst=0)
    parts = [torch.empty(6)]
    comm.all_gather(parts, t)
    assert torch.equal(parts[0], t)
    a, b = torch.ones(3), torch.full((2, 2), 2.0)
    comm.all_reduce_coalesced([a, b])
    assert torch.equal(a, torch.ones(3)) and torch.equal(b, torch.full((2, 2), 2.0))
    objects: list[object] = [None]
    comm.all_gather_object(objects, {"step": 3})
    assert objects == [{"step": 3}]
    comm.barrier()
    got = counts()
    assert got["grads"] == {24: 1}  # logged under its log_name, 6 fp32 = 24 bytes
    # allgather_fn and reduce_scatter_fn are filed under the collective they
    # run, as DeepSpeed files them (so prof_ops with that name counts them)
    assert got["all_gather_into_tensor"] == {24: 2}
    assert got["reduce_scatter_tensor"] == {24: 2}
    assert "allgather_fn" not in got and "reduce_scatter_fn" not in got
    assert got["broadcast"] == {24: 1} and got["reduce"] == {24: 1}
    assert got["all_gather"] == {24: 1}
    # all_reduce_coalesced (3 + 4 elements) is filed as all_reduce, as DeepSpeed files it
    assert got["all_reduce"] == {28: 1} and "all_reduce_coalesced" not in got
    assert got["all_gather_object"] == {0: 1} and got["barrier"] == {0: 1}
    assert comm.get_comm_operation_count() == 11
    assert comm.has_comm_data()
    comm.reset_log()
    assert not comm.has_comm_data() and comm.get_logged_comm_ops() == []


def test_async_ops_are_complete_when_profiled(solo: None, logger: None) -> None:
    work = comm.all_reduce(torch.ones(4), async_op=True)
    assert work.is_completed()  # timed blocking, as DeepSpeed does
    work.wait()  # and still a work handle the caller can wait on
    LOGGER.configure(enabled=False)
    work = comm.all_reduce(torch.ones(4), async_op=True)
    work.wait()
    assert counts() == {"all_reduce": {16: 1}}  # the unlogged one is not there
    t = torch.ones(2)
    assert comm.all_reduce_coalesced([t], async_op=True).wait()  # done within the call
    assert torch.equal(t, torch.ones(2))


def test_prof_ops_and_prof_select(solo: None, logger: None) -> None:
    LOGGER.configure(prof_all=False, prof_ops=["broadcast"])
    t = torch.ones(2)
    comm.broadcast(t, 0)
    comm.all_reduce(t)
    comm.all_reduce(t, prof=True)
    assert counts() == {"broadcast": {8: 1}, "all_reduce": {8: 1}}


def test_deepspeeds_fn_names_count_as_the_collective_they_run(solo: None, logger: None) -> None:
    """prof_ops names the collective, as in DeepSpeed: allgather_fn and
    reduce_scatter_fn are profiled (and filed) as all_gather_into_tensor and
    reduce_scatter_tensor."""
    LOGGER.configure(prof_all=False, prof_ops=["all_gather_into_tensor",
                                               "reduce_scatter_tensor"])
    t, out = torch.ones(2), torch.empty(2)
    comm.allgather_fn(out, t)
    comm.reduce_scatter_fn(out, t)
    assert counts() == {"all_gather_into_tensor": {8: 1}, "reduce_scatter_tensor": {8: 1}}


def test_debug_names_the_calling_function(solo: None, logger: None) -> None:
    LOGGER.configure(debug=True)

    def my_training_step() -> None:
        comm.all_reduce(torch.ones(1))

    my_training_step()
    assert comm.get_logged_comm_ops() == ["all_reduce | [Caller Func: my_training_step]"]


def test_log_summary_prints_and_returns(solo: None, logger: None,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    comm.all_reduce(torch.ones(256))
    comm.all_reduce(torch.ones(256))
    result = comm.log_summary(show_straggler=True, return_dict=True)
    assert result is not None
    row = result["summary"]["all_reduce"][1024]
    assert row["count"] == 2 and row["total_latency_ms"] > 0
    # DeepSpeed's layout; with one rank it is its own fastest: no straggling
    (straggle,) = result["straggler_analysis"]["all_reduce"].values()
    assert straggle["count"] == 2 and straggle["total_straggler_ms"] == 0.0
    assert straggle["total_comm_lat_ms"] == pytest.approx(row["total_latency_ms"])
    assert straggle["msg_size_bytes"] == 1024 and straggle["msg_size_str"] == "1.0 KB"
    assert result["metadata"]["world_size"] == 1 and result["metadata"]["rank"] == 0
    printed = capsys.readouterr().out
    assert "Comm. Op" in printed and "all_reduce" in printed and "1.0 KB" in printed
    assert comm.log_summary() is None
    assert list(LOGGER.summary()) == ["all_reduce"]  # its own barriers are not logged


def test_configure_from_a_resolved_config(solo: None, logger: None) -> None:
    from dsrun.runtime.config import resolve

    LOGGER.configure(enabled=False)
    config = resolve({"train_batch_size": 1, "comms_logger": {
        "enabled": True, "prof_all": False, "prof_ops": ["all_reduce"]}},
        dp_size=1, dp_source="test")
    comm.configure(config)
    assert (LOGGER.enabled, LOGGER.prof_all, LOGGER.prof_ops) == (True, False, ["all_reduce"])
    comm.configure(enabled=False)
    assert not LOGGER.enabled


def test_ranks_and_groups(solo: None, monkeypatch: pytest.MonkeyPatch) -> None:
    assert comm.is_initialized() and comm.is_available()
    assert (comm.get_rank(), comm.get_world_size()) == (0, 1)
    assert comm.get_all_ranks_from_group() == [0]
    group = comm.new_group([0])
    assert comm.get_all_ranks_from_group(group) == [0]
    assert comm.get_global_rank(group, 0) == 0
    assert comm.get_world_group() is torch.distributed.group.WORLD
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert comm.get_local_rank() == 3
    assert comm.has_all_gather_into_tensor() and comm.has_reduce_scatter_tensor()


def test_before_a_process_group(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    monkeypatch.setenv("RANK", "2")
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert not comm.is_initialized()
    assert (comm.get_rank(), comm.get_world_size()) == (2, 4)


def test_rank_and_size_from_the_launcher(monkeypatch: pytest.MonkeyPatch) -> None:
    """DeepSpeed's ``get_*_from_launcher``: what the launcher's environment
    says (dsrun's/torchrun's variables, else MPI's), without a group."""
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("OMPI_COMM_WORLD_RANK", "5")
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "8")
    monkeypatch.setenv("OMPI_COMM_WORLD_LOCAL_RANK", "1")
    monkeypatch.setenv("OMPI_COMM_WORLD_LOCAL_SIZE", "4")
    assert comm.get_world_rank_from_launcher() == 5
    assert comm.get_world_size_from_launcher() == 8
    assert comm.get_local_rank_from_launcher() == 1
    monkeypatch.setenv("RANK", "2")
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert (comm.get_world_rank_from_launcher(), comm.get_world_size_from_launcher()) == (2, 3)


def test_the_module_level_comms_logger(solo: None, logger: None) -> None:
    """``deepspeed.comm.comms_logger``: the logger itself, its records in
    DeepSpeed's ``comms_dict`` layout."""
    from deepspeed.comm import comms_logger  # the alias finder

    assert comms_logger is LOGGER and comms_logger.enabled
    comm.all_reduce(torch.ones(4))
    count, latencies_ms, algbws, busbws = comms_logger.comms_dict["all_reduce"][16]
    assert count == 1 and len(latencies_ms) == len(algbws) == len(busbws) == 1
    assert latencies_ms[0] == pytest.approx(LOGGER.summary()["all_reduce"][16]
                                            ["total_latency_ms"])
    from deepspeed.utils.comms_logging import CommsLogger, calc_bw_log

    assert isinstance(comms_logger, CommsLogger)
    assert calc_bw_log("all_reduce", 16, latencies_ms[0]) == pytest.approx(
        (algbws[0], busbws[0]))


def test_deepspeed_spelling() -> None:
    import dsrun as deepspeed

    assert deepspeed.comm is comm
    from deepspeed import comm as dist  # the alias finder (no DeepSpeed installed)

    assert dist is comm


def test_model_parallel_norm_helpers_are_logged(solo: None, logger: None) -> None:
    """``runtime.utils.clip_grad_norm_`` and the norm helpers reduce over the
    mpu's group through ``dsrun.comm``, so the logger counts each reduction."""
    from types import SimpleNamespace

    import torch.distributed as dist

    from dsrun.runtime.utils import clip_grad_norm_, get_weight_norm

    mpu = SimpleNamespace(get_model_parallel_group=lambda: dist.group.WORLD,
                          get_model_parallel_rank=lambda: 0)
    param = torch.nn.Parameter(torch.ones(4))
    param.grad = torch.full((4,), 2.0)
    assert float(clip_grad_norm_([param], 100.0, mpu=mpu)) == pytest.approx(4.0)
    assert float(clip_grad_norm_([param], 100.0, norm_type=float("inf"), mpu=mpu)) == 2.0
    assert get_weight_norm([param], mpu=mpu) == pytest.approx(2.0)
    assert sum(counts()["all_reduce"].values()) == 3


def test_a_config_with_the_logger_disabled_switches_it_off(solo: None, logger: None) -> None:
    """As DeepSpeed's dist.configure, which every engine calls: the last
    engine's config decides, also when it turns the logger off."""
    from dsrun.runtime.config import resolve

    LOGGER.configure(enabled=True, prof_all=True)
    for section, expected in (({"enabled": False}, False), ({}, False),
                              ({"enabled": True, "prof_all": False}, True)):
        config = resolve({"train_batch_size": 1, "comms_logger": section}, dp_size=1,
                         dp_source="test")
        comm.configure(config)
        assert LOGGER.enabled is expected, section
    assert LOGGER.prof_all is False


def test_an_engine_without_the_logger_switches_it_off(solo: None, logger: None) -> None:
    import dsrun

    LOGGER.configure(enabled=True, prof_all=True)
    engine, *_ = dsrun.initialize(model=torch.nn.Linear(2, 2), config={
        "train_batch_size": 1, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
    try:
        assert not LOGGER.enabled
    finally:
        engine.destroy()
