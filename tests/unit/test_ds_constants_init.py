"""``deepspeed.constants`` and ``deepspeed.init_distributed``'s signature
(DeepSpeed 0.19.8's): the module and its values through the ``deepspeed``
alias; unknown keywords refused by name; DeepSpeed's positional order;
``config=`` turning the communication logger on; ``dist_init_required``.
The process-group calls are stubbed where a group would be made."""

from __future__ import annotations

import datetime
import importlib
import inspect
from collections.abc import Iterator
from typing import Any

import pytest
import torch

import dsrun
from dsrun.errors import DsrunError
from dsrun.runtime import dist as rdist
from dsrun.runtime.commlog import LOGGER
from dsrun.runtime.env import DistEnv

#: deepspeed/comm/comm.py:init_distributed's parameters in 0.19.8, in order
DEEPSPEED_PARAMETERS = ["dist_backend", "auto_mpi_discovery", "distributed_port", "verbose",
                        "timeout", "init_method", "dist_init_required", "config", "rank",
                        "world_size"]
SOLO = DistEnv(rank=0, world_size=1, accelerator="cpu")


def test_constants_module_through_the_alias() -> None:
    import deepspeed  # the alias dsrun installs (DeepSpeed is not installed here)
    from deepspeed.constants import (
        CROSS_RANK,
        CROSS_SIZE,
        INFERENCE_GENERIC_MODE,
        INFERENCE_SPECIALIZED_MODE,
        LOCAL_RANK,
        TORCH_DISTRIBUTED_DEFAULT_PORT,
        default_pg_timeout,
    )

    assert deepspeed is dsrun and dsrun.constants is importlib.import_module("dsrun.constants")
    assert TORCH_DISTRIBUTED_DEFAULT_PORT == 29500 == dsrun.TORCH_DISTRIBUTED_DEFAULT_PORT
    assert (INFERENCE_GENERIC_MODE, INFERENCE_SPECIALIZED_MODE) == ("generic", "specialized")
    assert (CROSS_RANK, CROSS_SIZE, LOCAL_RANK) == ("CROSS_RANK", "CROSS_SIZE", "LOCAL_RANK")
    assert isinstance(default_pg_timeout, datetime.timedelta)
    assert dsrun.comm.default_pg_timeout is default_pg_timeout  # deepspeed.comm has it too
    assert "constants" in dir(dsrun)


def test_default_pg_timeout_is_deepspeed_timeout_else_10_minutes(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import dsrun.constants as constants

    try:
        monkeypatch.setenv("DEEPSPEED_TIMEOUT", "3")
        assert importlib.reload(constants).default_pg_timeout == datetime.timedelta(minutes=3)
        monkeypatch.delenv("DEEPSPEED_TIMEOUT")
        assert importlib.reload(constants).default_pg_timeout == datetime.timedelta(minutes=10)
        monkeypatch.setenv("DEEPSPEED_TIMEOUT", "soon")
        with pytest.raises(DsrunError, match="DEEPSPEED_TIMEOUT='soon'"):
            importlib.reload(constants)
    finally:
        monkeypatch.delenv("DEEPSPEED_TIMEOUT", raising=False)
        importlib.reload(constants)


def test_init_distributed_has_deepspeeds_signature() -> None:
    for function in (dsrun.init_distributed, dsrun.comm.init_distributed):
        params = inspect.signature(function).parameters
        positional = [name for name, p in params.items()
                      if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD]
        assert positional == DEEPSPEED_PARAMETERS
        assert not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


@pytest.fixture
def made(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """No group yet; what init_distributed would make it with (its
    init_process_group keywords, and ``compat``: what reached the rendezvous)."""
    calls: list[dict[str, Any]] = []
    monkeypatch.setattr(rdist.dist, "is_initialized", lambda: False)
    monkeypatch.setattr(rdist, "_original_init", lambda **kw: calls.append(kw))
    monkeypatch.setattr(rdist.atexit, "register", lambda fn: fn)
    monkeypatch.setattr(rdist, "_owned_by_dsrun", False)
    real = rdist._rendezvous

    def rendezvous(env: DistEnv, backend: str, timeout: Any, compat: dict[str, Any]) -> Any:
        calls.append({"compat": dict(compat)})
        return real(env, backend, timeout, compat)
    monkeypatch.setattr(rdist, "_rendezvous", rendezvous)
    return calls


def test_unknown_keywords_are_refused_by_name(made: list[dict[str, Any]]) -> None:
    with pytest.raises(TypeError, match="unexpected keyword argument 'dist_init_requird'"):
        dsrun.init_distributed(dist_backend="gloo", dist_init_requird=True)  # type: ignore
    assert made == []


def test_deepspeeds_positional_order(made: list[dict[str, Any]]) -> None:
    four = datetime.timedelta(seconds=4)
    dsrun.init_distributed("gloo", True, 29501, False, four, None, None, None, 0, 1, env=SOLO)
    compat, kwargs = made
    assert compat == {"compat": {"distributed_port": 29501, "rank": 0, "world_size": 1}}
    assert (kwargs["backend"], kwargs["timeout"], kwargs["rank"], kwargs["world_size"]) == (
        "gloo", four, 0, 1)
    made.clear()
    dsrun.init_distributed("gloo", True, env=SOLO)  # torch's "Expected timeout ..." before
    assert made[-1]["backend"] == "gloo" and "timeout" not in made[-1]


def test_timeout_must_be_a_timedelta(made: list[dict[str, Any]]) -> None:
    with pytest.raises(TypeError, match=r"init_distributed\(timeout=30\): the timeout is a "
                                        r"datetime.timedelta, got int"):
        dsrun.init_distributed(dist_backend="gloo", timeout=30)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="dist_backend='gloo' and backend='nccl'"):
        dsrun.init_distributed("gloo", backend="nccl")
    assert made == []


def test_dist_init_required_false_needs_a_group(made: list[dict[str, Any]]) -> None:
    with pytest.raises(DsrunError, match=r"dist_init_required=False\) needs a process group"):
        dsrun.init_distributed(dist_backend="gloo", dist_init_required=False)
    assert made == []


@pytest.fixture
def logger_off() -> Iterator[None]:
    LOGGER.configure(enabled=False, prof_all=True, prof_ops=[], verbose=False, debug=False)
    LOGGER.reset()
    try:
        yield
    finally:
        LOGGER.configure(enabled=False, prof_all=True, prof_ops=[], verbose=False, debug=False)
        LOGGER.reset()


@pytest.mark.parametrize("kind", ["DeepSpeedConfig", "dict"])
def test_config_turns_the_comms_logger_on(solo: None, logger_off: None, kind: str) -> None:
    """As DeepSpeed's init_distributed(config=...) does (it used to be ignored)."""
    from deepspeed.runtime.config import DeepSpeedConfig

    raw = {"train_batch_size": 1, "comms_logger": {"enabled": True, "prof_all": False,
                                                   "prof_ops": ["all_reduce"]}}
    config = DeepSpeedConfig(raw) if kind == "DeepSpeedConfig" else raw
    dsrun.init_distributed(dist_backend="gloo", config=config)
    assert (LOGGER.enabled, LOGGER.prof_all, LOGGER.prof_ops) == (True, False, ["all_reduce"])
    dsrun.comm.all_reduce(torch.ones(1))
    assert dsrun.comm.get_logged_comm_ops() == ["all_reduce"]


def test_a_config_without_the_section_leaves_the_logger(solo: None, logger_off: None) -> None:
    dsrun.init_distributed(config={"train_batch_size": 1})
    assert not LOGGER.enabled
    with pytest.raises(TypeError, match="takes a DeepSpeedConfig, a resolved dsrun config or "
                                        "a config dict, got str"):
        dsrun.init_distributed(config="ds_config.json")
