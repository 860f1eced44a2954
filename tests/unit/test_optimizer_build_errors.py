"""Which constructor errors ``build_optimizer`` blames on ``optimizer.params``:
only those the config's params cause (they fail over a stand-in parameter
too); the script's parameters and other failures keep their own
exception."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from dsrun.errors import DsrunConfigError
from dsrun.runtime import optimizers
from dsrun.runtime.config import OptimizerConfig
from dsrun.runtime.optimizers import build_optimizer

ADAMW = OptimizerConfig("adamw", {"lr": 0.1}, source="ds.json")


def weights() -> list[torch.nn.Parameter]:
    return [torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(3))]


def test_a_parameter_in_two_groups_is_the_scripts_error() -> None:
    p = weights()
    with pytest.raises(ValueError, match="more than one parameter group") as err:
        build_optimizer(ADAMW, [{"params": p}, {"params": p[:1]}])
    assert not isinstance(err.value, DsrunConfigError)
    assert "optimizer.params" not in str(err.value)


def test_a_group_without_params_is_the_scripts_error() -> None:
    with pytest.raises(KeyError, match="params") as err:
        build_optimizer(ADAMW, [{"parameters": weights()}])
    assert not isinstance(err.value, DsrunConfigError)


def test_an_empty_parameter_list_is_the_scripts_error() -> None:
    with pytest.raises(ValueError, match="empty parameter list") as err:
        build_optimizer(ADAMW, iter(()))
    assert not isinstance(err.value, DsrunConfigError)


class Broken(torch.optim.SGD):
    """An optimizer whose constructor has a bug of its own."""

    def __init__(self, params: Any, lr: float = 0.1) -> None:
        super().__init__(params, lr=lr)
        raise RuntimeError("internal failure")


def test_other_exceptions_propagate_unchanged(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(optimizers.OPTIMIZER_CLASSES, "sgd", Broken)
    with pytest.raises(RuntimeError, match="^internal failure$") as err:
        build_optimizer(OptimizerConfig("sgd", {"lr": 0.1}), weights())
    assert err.value.__cause__ is None and err.traceback[-1].name == "__init__"


@pytest.mark.parametrize("params, match", [
    ({"betas": (0.9,)}, "IndexError"),
    ({"lr": 0.1, "eps": -1.0}, "Invalid epsilon"),
])
def test_the_configs_params_are_the_configs_error(params: dict, match: str) -> None:
    # built without the config check (as from_deepspeed does); over a
    # generator, which the stand-in probe must not need to read again
    config = OptimizerConfig("adam", params, source="ds.json")
    with pytest.raises(DsrunConfigError, match=rf'"optimizer.params" in ds.json.*{match}'):
        build_optimizer(config, (p for p in weights()))


def test_a_generator_of_groups_still_builds() -> None:
    optimizer = build_optimizer(ADAMW, ({"params": [p]} for p in weights()))
    assert [len(group["params"]) for group in optimizer.param_groups] == [1, 1]
