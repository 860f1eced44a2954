"""``dsrun.comm`` as DeepSpeed's ``deepspeed.comm`` package: every
submodule by its DeepSpeed path (``comm.comm``, ``comm.utils``,
``comm.reduce_op``, ``comm.constants``, ``comm.config``, ``comm.backend``,
``comm.pg_utils``), DeepSpeed's ``ReduceOp`` in the collectives, and the
helpers of ``deepspeed.comm.utils`` with DeepSpeed's results. The
collectives themselves: tests/dist/test_comm_api.py."""

from __future__ import annotations

import importlib
import inspect
from dataclasses import fields
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import dsrun
from dsrun import comm
from dsrun.comm import utils as comm_utils
from dsrun.errors import DsrunConfigError
from dsrun.runtime.commlog import LOGGER

SUBMODULES = ("comm", "utils", "reduce_op", "constants", "config", "backend", "pg_utils")


@pytest.mark.parametrize("name", SUBMODULES)
def test_each_submodule_by_its_deepspeed_path(name: str) -> None:
    import dsrun as deepspeed  # noqa: F401 - installs the deepspeed alias

    ours = importlib.import_module(f"dsrun.comm.{name}")
    assert importlib.import_module(f"deepspeed.comm.{name}") is ours
    assert getattr(comm, name) is ours  # an attribute of the package, as in DeepSpeed


def test_the_package_re_exports_the_api() -> None:
    import dsrun.comm as imported

    assert imported is comm and dsrun.comm is comm
    for name in comm.__all__:
        assert getattr(comm, name) is getattr(comm.comm, name), name
    for name in ("all_reduce", "log_summary", "get_world_size_from_launcher", "ReduceOp",
                 "get_tensor_position", "NCCL_BACKEND", "comms_logger", "init_distributed"):
        assert name in comm.__all__, name
    from deepspeed.comm.comm import all_reduce, init_distributed
    from deepspeed.comm.utils import get_world_rank_from_launcher

    assert all_reduce is comm.all_reduce and init_distributed is dsrun.init_distributed
    assert get_world_rank_from_launcher is comm.get_world_rank_from_launcher
    assert comm.TORCH_DISTRIBUTED_DEFAULT_PORT == dsrun.TORCH_DISTRIBUTED_DEFAULT_PORT == 29500
    assert "is_parallel" not in comm.__all__  # pg_utils stays apart, as in DeepSpeed


def test_modules_stay_under_the_house_limit() -> None:
    for path in Path(comm.__file__).parent.glob("*.py"):
        assert len(path.read_text().splitlines()) <= 500, path.name


# ------------------------------------------------------------ ReduceOp


def test_reduce_op_is_deepspeeds_enum() -> None:
    from deepspeed.comm.reduce_op import ReduceOp

    assert ReduceOp is comm.ReduceOp and issubclass(ReduceOp, __import__("enum").Enum)
    assert [(op.name, op.value) for op in ReduceOp] == [
        ("SUM", 0), ("PRODUCT", 1), ("MIN", 2), ("MAX", 3), ("BAND", 4), ("BOR", 5),
        ("BXOR", 6), ("AVG", 7), ("UNUSED", 8)]


def test_reduce_op_becomes_torchs() -> None:
    from dsrun.comm.reduce_op import to_torch

    for op in comm.ReduceOp:
        if op is not comm.ReduceOp.UNUSED:
            assert to_torch(op) == getattr(dist.ReduceOp, op.name)
    assert to_torch(dist.ReduceOp.MAX) is dist.ReduceOp.MAX  # torch's own: unchanged
    with pytest.raises(ValueError, match="ReduceOp.UNUSED is not a reduction"):
        to_torch(comm.ReduceOp.UNUSED)


def test_collectives_take_either_reduce_op(solo: None) -> None:
    """DeepSpeed's enum reaches torch as torch's operation (torch refuses the
    enum itself); dsrun's own code passes torch's."""
    for op in (comm.ReduceOp.MAX, dist.ReduceOp.MAX):
        t = torch.tensor([1.0, 5.0])
        comm.all_reduce(t, op=op)
        comm.reduce(t, 0, op=op)
        out = torch.empty(2)
        comm.reduce_scatter_tensor(out, t, op=op)
        comm.reduce_scatter_fn(out, t, op=op)
        comm.reduce_scatter(out, [t], op=op)
        comm.all_reduce_coalesced([t], op=op)
        comm.inference_all_reduce(t, op=op)
        assert torch.equal(out, t) and t.tolist() == [1.0, 5.0]


# ------------------------------------------------------------ utils


def test_get_default_args() -> None:
    def f(a: int, b: int = 2, *, c: str = "x") -> None: ...

    assert comm_utils.get_default_args(f) == {"b": 2, "c": "x"}
    assert comm_utils.get_default_args(comm.all_reduce)["log_name"] == "all_reduce"


@pytest.mark.parametrize(("func", "position"), [
    (comm.all_reduce, 0), (comm.broadcast, 0), (comm.all_gather, 1),
    (comm.all_reduce_coalesced, 0), (comm.reduce_scatter, 1), (comm.all_to_all, 1),
    (comm.batch_isend_irecv, 0), (comm.barrier, -1), (dist.all_gather_into_tensor, -1),
    (dist.all_to_all, 1), (dist.reduce_scatter, 1), (dist.all_reduce, 0)])
def test_get_tensor_position(func: object, position: int) -> None:
    """DeepSpeed's answers (torch's all_gather_into_tensor names its input
    ``input_tensor``, which DeepSpeed does not look for)."""
    assert comm_utils.get_tensor_position(func) == position


def test_message_size_of_a_call() -> None:
    t = torch.ones(6)  # 24 bytes
    size = comm_utils.get_msg_size_from_args
    assert size(comm.all_reduce, t) == 24
    assert size(comm.all_reduce, tensor=t) == 24
    assert size(comm.all_gather, [torch.empty(6)], t) == 24
    assert size(comm.all_to_all, [], [t, torch.ones(2, dtype=torch.float16)]) == 28
    assert size(comm.barrier) == 0 and size(comm.barrier, group=None) == 0
    ops = [comm.P2POp(comm.isend, t, 1), comm.P2POp(comm.irecv, torch.ones(2), 1)]
    assert size(comm.batch_isend_irecv, ops) == 32
    assert comm_utils.get_tensor_kwarg(comm.reduce_scatter, {"input_list": [t]}) == [t]
    assert comm_utils.get_tensor_kwarg(comm.barrier, {"group": None}) is None


def test_debug_log_name_names_the_callers_caller() -> None:
    def collective(debug: bool) -> str:  # stands for DeepSpeed's timed_op wrapper
        return comm_utils.get_debug_log_name({"log_name": "all_reduce"}, debug)

    def train_step(debug: bool) -> str:
        return collective(debug)

    assert train_step(False) == "all_reduce"
    assert train_step(True) == "all_reduce | [Caller Func: train_step]"


# ------------------------------------------------------------ constants, config


def test_constants_are_deepspeeds_and_agree_with_the_config_section() -> None:
    from dsrun.comm import constants as c
    from dsrun.runtime.config_monitors import CommsLoggerConfig

    assert (c.NCCL_BACKEND, c.GLOO_BACKEND, c.MPI_BACKEND, c.CCL_BACKEND) == (
        "nccl", "gloo", "mpi", "ccl")
    assert comm.NCCL_BACKEND == "nccl" and c.COMMS_LOGGER == "comms_logger"
    defaults = {f.name: f.default for f in fields(CommsLoggerConfig)}
    assert defaults == {
        c.COMMS_LOGGER_ENABLED: c.COMMS_LOGGER_ENABLED_DEFAULT,
        c.COMMS_LOGGER_VERBOSE: c.COMMS_LOGGER_VERBOSE_DEFAULT,
        c.COMMS_LOGGER_PROF_ALL: c.COMMS_LOGGER_PROF_ALL_DEFAULT,
        c.COMMS_LOGGER_DEBUG: c.COMMS_LOGGER_DEBUG_DEFAULT,
        c.COMMS_LOGGER_PROF_OPS: tuple(c.COMMS_LOGGER_PROF_OPS_DEFAULT)}


def test_deepspeed_comms_config_and_configure() -> None:
    from deepspeed.comm.config import CommsLoggerConfig, DeepSpeedCommsConfig

    assert not DeepSpeedCommsConfig({"train_batch_size": 1}).comms_logger_enabled
    config = DeepSpeedCommsConfig({"comms_logger": {"enabled": True, "prof_all": False,
                                                    "prof_ops": ["all_reduce"]}})
    assert config.comms_logger_enabled and isinstance(config.comms_logger, CommsLoggerConfig)
    assert config.comms_logger.prof_ops == ("all_reduce",)
    try:
        comm.configure(config)
        assert (LOGGER.enabled, LOGGER.prof_all, LOGGER.prof_ops) == (
            True, False, ["all_reduce"])
    finally:
        comm.configure(enabled=False, prof_all=True, prof_ops=[])
    with pytest.raises(DsrunConfigError, match='unknown key "enabeld".*did you mean "enabled"'):
        DeepSpeedCommsConfig({"comms_logger": {"enabeld": True}})
    with pytest.raises(TypeError, match="takes the config as a dict, got str"):
        DeepSpeedCommsConfig("ds_config.json")  # type: ignore[arg-type]


# ------------------------------------------------------------ backend, pg_utils, the rest


def test_backend_base_class() -> None:
    from deepspeed.comm.backend import Backend

    backend = Backend(name="torch", rank=3, size=8)
    assert (backend.name, backend.world_rank, backend.world_size) == ("torch", 3, 8)
    assert backend.process_groups == [] and not backend.is_initialized()
    backend.init_process_group()
    assert backend.is_initialized()


def test_pg_utils_is_parallel(solo: None) -> None:
    from deepspeed.comm import pg_utils

    assert not pg_utils.is_parallel(None)  # no dimension, not the world
    assert not pg_utils.is_parallel(comm.get_world_group())  # one rank


def test_process_group_record_and_environments(monkeypatch: pytest.MonkeyPatch) -> None:
    group = comm.ProcessGroup(7, ranks=[0, 2])
    assert (group.comm_id, group.ranks, group.size) == (7, [0, 2], 2)
    for name, variable in (("in_aml", "AZUREML_EXPERIMENT_ID"), ("in_aws_sm", "SM_TRAINING_ENV"),
                           ("in_dlts", "DLTS_JOB_ID")):
        monkeypatch.delenv(variable, raising=False)
        assert not getattr(comm, name)()
        monkeypatch.setenv(variable, "x")
        assert getattr(comm, name)()


def test_initialize_mesh_device(solo: None) -> None:
    mesh = comm.initialize_mesh_device((1,), ("dp",))
    assert mesh.device_type == "cpu" and mesh.mesh_dim_names == ("dp",)
    assert mesh.get_group("dp") is not None


def test_initialize_mesh_device_needs_a_group() -> None:
    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    with pytest.raises(RuntimeError, match="no process group yet"):
        comm.initialize_mesh_device((1,), None)


def test_signatures_keep_deepspeeds_keywords() -> None:
    """DeepSpeed's keywords on every collective (torch's plus prof, log_name, debug)."""
    for name in ("all_reduce", "broadcast", "all_gather_into_tensor", "reduce_scatter_tensor",
                 "all_to_all_single", "send", "isend", "barrier", "gather"):
        params = inspect.signature(getattr(comm, name)).parameters
        assert {"prof", "log_name", "debug"} <= set(params), name
