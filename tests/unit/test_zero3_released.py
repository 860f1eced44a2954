"""A released ZeRO-3 parameter (one rank: ``partition_param`` without
``persist`` releases it) reports its logical shape with empty data; the
Python methods that would combine the two - ``reshape``, ``view``,
``permute``, ``expand``, ``copy_``, ``copy.deepcopy`` - raise
:class:`ReleasedParameterError` naming it (before: ``reshape(2, -1)`` gave
a ``(2, 0)`` tensor, ``copy_`` torch's size error, a deep copy a parameter
without values); gathered, they are torch's. In-place writes (``fill_``,
``normal_``, ``mul_``...) are refused too (they did nothing).

While a ``zero.Init`` context is open, a deep copy is a partitioned copy
(new id, its own shard, the same values; it was refused, which broke
``nn.TransformerEncoder`` under ``zero.Init``) and a write runs on the
whole parameter: ``constant_``/``normal_`` give what torch gives on a
plain tensor from the same random state (``constant_`` did nothing).

A module compiled before ``initialize()`` at stage 3 is refused only where
stage 3 hooks the forward: at world size 1 every parameter is kept whole
(no hooks) and it trains, also with a forward that calls the checked
``view`` under ``fullgraph=True``; with ``offload_param`` it is hooked and
refused.
"""

from __future__ import annotations

import copy
from typing import Any, Callable

import pytest
import torch

import dsrun
from dsrun.runtime.zero.compiled import CompiledModuleError
from dsrun.runtime.zero.gathered import GatheredParameters
from dsrun.runtime.zero.partitioned import gather, partition_param, release
from dsrun.runtime.zero.released import ReleasedParameterError


def released_param() -> torch.nn.Parameter:
    param = torch.nn.Parameter(torch.arange(6.0).view(2, 3))
    partition_param(param, group=None, persist=False, name="block.weight")
    assert param.data.numel() == 0 and param.shape == (2, 3)
    return param


USES: dict[str, Callable[[torch.Tensor], Any]] = {
    "reshape": lambda p: p.reshape(p.size(0), -1),
    "view": lambda p: p.view(p.shape),
    "permute": lambda p: p.permute(1, 0),
    "expand": lambda p: p.expand(2, 3),
    "copy values into": lambda p: p.copy_(torch.arange(6.0).view(2, 3)),
    "copy.deepcopy": copy.deepcopy,
}


@pytest.mark.parametrize("action", list(USES))
def test_using_a_released_parameter_names_it(solo: None, action: str) -> None:
    param = released_param()
    with torch.no_grad(), pytest.raises(
            ReleasedParameterError,
            match=rf"cannot {action} block\.weight of shape \(2, 3\): it is partitioned by "
                  r"ZeRO stage 3 and released on this rank, which holds only a shard of 6 "
                  r"of its 6 elements.*GatheredParameters"):
        USES[action](param)
    gather([param])  # gathered: torch's methods
    with torch.no_grad():
        result = USES[action](param)
    assert tuple(result.shape) == ((3, 2) if action == "permute" else (2, 3))
    if action == "copy.deepcopy":
        assert torch.equal(result.data, torch.arange(6.0).view(2, 3))
    release(param)


WRITES: dict[str, Callable[[torch.Tensor], Any]] = {
    "fill_": lambda p: torch.nn.init.constant_(p, 0.5),
    "zero_": torch.nn.init.zeros_,
    "normal_": torch.nn.init.normal_,
    "uniform_": lambda p: torch.nn.init.xavier_uniform_(p),
    "mul_": lambda p: p.mul_(0.9),
    "add_": lambda p: p.add_(1.0),
}


@pytest.mark.parametrize("action", list(WRITES))
def test_writing_a_released_parameter_is_refused(solo: None, action: str) -> None:
    param = released_param()
    with torch.no_grad(), pytest.raises(
            ReleasedParameterError,
            match=rf"cannot {action} block\.weight of shape \(2, 3\): it is partitioned.*"
                  r"GatheredParameters\(\[param\], modifier_rank=0\)"):
        WRITES[action](param)
    gather([param])
    assert torch.equal(param.data, torch.arange(6.0).view(2, 3))  # unchanged
    with torch.no_grad():
        WRITES[action](param)  # gathered: torch's
    release(param)


@pytest.mark.parametrize("action", ["fill_", "normal_", "uniform_", "mul_"])
def test_under_init_a_write_applies_to_the_whole_parameter(solo: None, action: str) -> None:
    param = released_param()
    want = torch.arange(6.0).view(2, 3)
    torch.manual_seed(1)
    with torch.no_grad():
        WRITES[action](want)
    next_plain = torch.rand(3)  # the random stream goes on as torch's
    torch.manual_seed(1)
    with dsrun.zero.Init(), torch.no_grad():
        WRITES[action](param)
    assert torch.equal(torch.rand(3), next_plain)
    assert param.data.numel() == 0  # released again
    with GatheredParameters([param]):
        assert torch.equal(param.data, want), (param.data, want)


def test_under_init_a_deep_copy_is_partitioned(solo: None) -> None:
    param = released_param()
    with dsrun.zero.Init():
        twin = copy.deepcopy(param)
    assert twin.ds_id != param.ds_id and twin.data.numel() == 0
    assert twin.ds_tensor.data_ptr() != param.ds_tensor.data_ptr()
    with GatheredParameters([param, twin]):
        assert torch.equal(twin.data, torch.arange(6.0).view(2, 3))
    assert twin.data.numel() == 0


def _mlp() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 3))


def _config(**zero: Any) -> dict[str, Any]:
    return {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 0.0,
            "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
            "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0, **zero}}


class ViewNet(torch.nn.Module):
    """A forward that views its own flat weight: dynamo traces the checked
    ``view`` (it once stopped at the check's ``__dict__`` read)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.w = torch.nn.Parameter(torch.randn(12))
        self.b = torch.nn.Parameter(torch.zeros(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(x, self.w.view(3, 4).reshape(3, 4), self.b)


def _losses(compiled: bool) -> list[float]:
    model = ViewNet()
    wrapped = torch.compile(model, backend="eager", fullgraph=True) if compiled else model
    engine, *_ = dsrun.initialize(model=wrapped, config=_config(),
                                  model_parameters=model.parameters())
    losses = []
    for _ in range(2):
        loss = engine(torch.ones(2, 4)).pow(2).mean()
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def test_a_compiled_model_at_world_size_1_trains(solo: None) -> None:
    assert _losses(compiled=True) == _losses(compiled=False)


def test_a_compiled_model_hooked_at_world_size_1_is_refused(solo: None) -> None:
    model = _mlp()
    with pytest.raises(CompiledModuleError, match=r"the model was compiled before initialize"):
        dsrun.initialize(model=torch.compile(model, backend="eager"),
                         config=_config(offload_param={"device": "cpu"}),
                         model_parameters=model.parameters())
