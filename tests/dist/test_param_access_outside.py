"""``dsrun.utils``' per-parameter API at world size 1 (the ``solo`` group),
for what the optimizer does not hold yet:

* ``safe_get_full_grad`` of a trainable parameter left out of the optimizer
  answers its ``param.grad`` (DeepSpeed 0.19.8's first test), at stages 0-2;
* setting optimizer state before the first step is refused naming the
  parameter by its module name at every stage (stage 3 named it already).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import dsrun
from dsrun.errors import DsrunError
from dsrun.utils import safe_get_full_grad, safe_set_full_optimizer_state

pytestmark = pytest.mark.dist


def engine_for(stage: int, only_first: bool) -> tuple[Any, torch.nn.Sequential]:
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU(), torch.nn.Linear(5, 3))
    config = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 1000,
              "optimizer": {"type": "AdamW", "params": {"lr": 0.01}},
              "zero_optimization": {"stage": stage}}
    params = m[0].parameters() if only_first else m.parameters()
    engine, *_ = dsrun.initialize(model=m, config=config, model_parameters=params)
    return engine, m


@pytest.mark.parametrize("stage", (0, 1, 2))
def test_grad_of_a_parameter_outside_the_optimizer_is_its_grad(solo: None, stage: int) -> None:
    engine, m = engine_for(stage, only_first=True)
    engine.backward(engine(torch.randn(2, 6)).pow(2).sum())
    weight = m[2].weight
    assert weight.grad is not None
    assert safe_get_full_grad(weight) is weight.grad


@pytest.mark.parametrize("stage", (0, 1, 2, 3))
def test_state_set_before_the_first_step_names_the_parameter(solo: None, stage: int) -> None:
    _, m = engine_for(stage, only_first=False)
    with pytest.raises(DsrunError, match=r"2\.weight has no optimizer state 'exp_avg' yet"):
        safe_set_full_optimizer_state(m[2].weight, torch.zeros(3, 5), "exp_avg")
