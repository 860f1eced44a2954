"""DeepSpeed's ``deepspeed.OnDevice``, ``deepspeed.utils.instrument_w_nvtx``,
``deepspeed.utils.logging`` level helpers and ``deepspeed.runtime.utils``
helpers, as dsrun gives them."""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import dsrun
import dsrun.utils
from dsrun.runtime import utils as rt_utils
from dsrun.utils import logging as ds_logging

# ---------------------------------------------------------------- OnDevice

class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 3)
        self.register_buffer("steps", torch.zeros(2, dtype=torch.long))
        self.register_buffer("mask", torch.ones(3))


@pytest.mark.parametrize("device", ["meta", "cpu"])
def test_on_device_builds_modules_there_in_the_dtype(device: str) -> None:
    before = torch.get_default_dtype()
    assert dsrun.OnDevice is dsrun.utils.OnDevice
    with dsrun.OnDevice(dtype=torch.bfloat16, device=device, enabled=True):
        block = Block()
        explicit = torch.zeros(2, dtype=torch.float32)
    assert block.linear.weight.device.type == device and block.mask.device.type == device
    assert block.linear.weight.dtype == block.linear.bias.dtype == torch.bfloat16
    assert block.mask.dtype == torch.bfloat16 and block.steps.dtype == torch.long
    assert explicit.dtype == torch.float32  # an explicit dtype is kept (module docstring)
    assert torch.get_default_dtype() == before and torch.zeros(1).device.type == "cpu"


def test_on_device_disabled_or_failing_leaves_torch_as_it_was() -> None:
    with dsrun.OnDevice(dtype=torch.float16, device="meta", enabled=False):
        assert torch.nn.Linear(2, 2).weight.device.type == "cpu"
    with pytest.raises(ValueError), dsrun.OnDevice(dtype=torch.float16, device="meta"):
        raise ValueError("inside")
    assert torch.get_default_dtype() == torch.float32 and torch.ones(1).device.type == "cpu"
    with pytest.raises(TypeError, match="floating"):
        dsrun.OnDevice(dtype=torch.int8)


# ---------------------------------------------------------------- nvtx

def test_instrument_w_nvtx_returns_the_result(monkeypatch: pytest.MonkeyPatch) -> None:
    @dsrun.utils.instrument_w_nvtx
    def add(a: int, b: int = 1) -> int:
        return a + b

    assert add(2, b=3) == 5 and add.__name__ == "add"
    pushed: list[str] = []
    from dsrun.utils import nvtx

    monkeypatch.setattr(nvtx, "_USABLE", True)
    monkeypatch.setattr(torch.cuda.nvtx, "range_push", pushed.append)
    monkeypatch.setattr(torch.cuda.nvtx, "range_pop", lambda: pushed.append("pop"))
    assert add(1) == 2
    assert pushed == [add.__qualname__, "pop"]


# ---------------------------------------------------------------- logging

@pytest.fixture
def restore_level() -> Iterator[None]:
    saved = (ds_logging.logger.level, [h.level for h in ds_logging.logger.handlers])
    yield
    ds_logging.logger.setLevel(saved[0])
    for handler, level in zip(ds_logging.logger.handlers, saved[1]):
        handler.setLevel(level)


def test_level_helpers_act_on_dsruns_logger(restore_level: None) -> None:
    ds_logging.set_log_level_from_string("Debug")
    assert ds_logging.logger.level == logging.DEBUG == ds_logging.get_current_level()
    assert all(h.level == logging.DEBUG for h in ds_logging.logger.handlers)
    assert ds_logging.should_log_le("info") and ds_logging.should_log_le("debug")
    ds_logging.set_log_level_from_string("error")
    assert not ds_logging.should_log_le("warning") and ds_logging.should_log_le("critical")
    with pytest.raises(ValueError, match="loud"):
        ds_logging.set_log_level_from_string("loud")
    with pytest.raises(ValueError):
        ds_logging.should_log_le(logging.INFO)  # type: ignore[arg-type]


def test_logger_factory_makes_one_stdout_logger(capsys: pytest.CaptureFixture[str]) -> None:
    made = ds_logging.LoggerFactory.create_logger("dsrun-test-factory", level=logging.INFO)
    again = ds_logging.LoggerFactory.create_logger("dsrun-test-factory", level=logging.INFO)
    assert made is again and len(made.handlers) == 1 and not made.propagate
    made.info("hello")
    assert capsys.readouterr().out.count("[INFO]") == 1
    with pytest.raises(ValueError):
        ds_logging.LoggerFactory.create_logger()


def test_print_json_dist_writes_with_the_rank(tmp_path: Path) -> None:
    out = tmp_path / "m.json"
    ds_logging.print_json_dist({"loss": 1.5}, ranks=[0], path=str(out))
    assert json.loads(out.read_text()) == {"loss": 1.5, "rank": 0}


# ---------------------------------------------------------------- runtime.utils

def _grads(seed: int) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.zeros(n)) for n in (5, 3, 7)]
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen) * 3
    return params


@pytest.mark.parametrize("norm_type", [2, 1, 3.0, math.inf])
@pytest.mark.parametrize("max_norm", [0.5, 1e6])
def test_clip_grad_norm_matches_torch(norm_type: float, max_norm: float) -> None:
    ours, theirs = _grads(0), _grads(0)
    norm = rt_utils.clip_grad_norm_(ours, max_norm, norm_type=norm_type)
    expected = torch.nn.utils.clip_grad_norm_(theirs, max_norm, norm_type=norm_type)
    torch.testing.assert_close(norm, expected)
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a.grad, b.grad)


def test_clip_grad_norm_without_gradients_and_one_tensor() -> None:
    assert float(rt_utils.clip_grad_norm_([torch.nn.Parameter(torch.ones(2))], 1.0)) == 0.0
    p = _grads(1)[0]
    q = p.detach().clone().requires_grad_()
    q.grad = p.grad.clone()
    torch.testing.assert_close(rt_utils.clip_grad_norm_(p, 1.0),
                               torch.nn.utils.clip_grad_norm_(q, 1.0))


def test_get_global_norm_empty_cache_dummy_optim() -> None:
    assert rt_utils.get_global_norm([3.0, torch.tensor(4.0)]) == 5.0
    assert rt_utils.get_global_norm([1.0, float("nan")]) == math.inf
    assert rt_utils.get_global_norm([1.0, -1.0]) == math.inf
    rt_utils.empty_cache()  # CPU: nothing cached, no error
    params = [torch.nn.Parameter(torch.ones(1))]
    assert rt_utils.DummyOptim(params).param_groups == [{"params": params}]


def test_an_unmanaged_zero_parameter_deep_copies_as_a_plain_one() -> None:
    """nn.Parameter(p) of a partitioned p is a ZeroParameter without ZeRO
    state (weight_norm makes one); copy.deepcopy(model) must copy it."""
    import copy

    from dsrun.runtime.zero.partitioned import ZeroParameter, is_zero_param

    param = ZeroParameter(torch.arange(3.0))
    param.note = "kept"
    twin = copy.deepcopy(param)
    assert type(twin) is ZeroParameter and not is_zero_param(twin)
    assert torch.equal(twin, param) and twin.data_ptr() != param.data_ptr()
    assert twin.note == "kept" and twin.shape == (3,)


def test_tensor_model_parallel_rank_by_any_mpu_name() -> None:
    """One lookup for the norms, the engine and activation checkpointing:
    Megatron's new name, DeepSpeed's grid name, Megatron's old name, else 0."""
    from types import SimpleNamespace

    from dsrun.runtime.norms import tensor_model_parallel_rank

    assert tensor_model_parallel_rank(None) == 0
    assert tensor_model_parallel_rank(SimpleNamespace()) == 0
    assert tensor_model_parallel_rank(SimpleNamespace(get_model_parallel_rank=lambda: 4)) == 4
    assert tensor_model_parallel_rank(SimpleNamespace(
        get_slice_parallel_rank=lambda: 1, get_model_parallel_rank=lambda: 4)) == 1
    assert tensor_model_parallel_rank(SimpleNamespace(
        get_tensor_model_parallel_rank=lambda: 2, get_slice_parallel_rank=lambda: 1)) == 2
