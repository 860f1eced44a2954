"""``lr_scheduler=`` given to initialize(): a scheduler class is called with
the optimizer, as DeepSpeed calls any callable (it crashed inside torch at
the first step: the class was stepped as if it were an instance); a string,
number or dict is refused at initialize() (it failed at the first step with
"'str' object has no attribute 'step'"). World-size-1 gloo group."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist

import dsrun
from dsrun.errors import DsrunConfigError, DsrunError
from dsrun.runtime.env import DistEnv

CFG = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 1000,
       "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}


@pytest.fixture(scope="module")
def solo() -> Iterator[None]:
    created = not dist.is_initialized()
    if created:
        dsrun.init_distributed(env=DistEnv(accelerator="cpu"))
    yield
    if created:
        dist.destroy_process_group()


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "DSRUN_CONFIG", "MASTER_ADDR",
                "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)


def _step(engine: Any) -> None:
    loss = engine(torch.ones(2, 4)).pow(2).mean()
    engine.backward(loss)
    engine.step()


@pytest.mark.parametrize("stage", [0, 2])
def test_a_scheduler_class_is_called_with_the_optimizer(solo: None, stage: int) -> None:
    model = torch.nn.Linear(4, 1)
    engine, optimizer, _, scheduler = dsrun.initialize(
        model=model, config={**CFG, "zero_optimization": {"stage": stage}},
        lr_scheduler=torch.optim.lr_scheduler.ConstantLR)
    assert isinstance(scheduler, torch.optim.lr_scheduler.ConstantLR)
    assert engine.get_lr() == [pytest.approx(0.1 / 3)]  # ConstantLR's factor 1/3
    for _ in range(6):  # total_iters 5: back to the optimizer's lr
        _step(engine)
    assert engine.get_lr() == [pytest.approx(0.1)]


def test_a_factory_function_still_works(solo: None) -> None:
    model = torch.nn.Linear(4, 1)
    _, _, _, scheduler = dsrun.initialize(
        model=model, config=CFG,
        lr_scheduler=lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=2))
    assert isinstance(scheduler, torch.optim.lr_scheduler.StepLR)


@pytest.mark.parametrize("value", ["WarmupLR", 5, {"type": "WarmupLR"}])
def test_a_string_number_or_dict_is_refused_at_initialize(solo: None, value: Any) -> None:
    with pytest.raises(DsrunConfigError, match=rf"lr_scheduler= is {type(value).__name__} "
                                               r".*not an LR scheduler"):
        dsrun.initialize(model=torch.nn.Linear(4, 1), config=CFG, lr_scheduler=value)


def test_a_factory_returning_something_else_is_refused(solo: None) -> None:
    with pytest.raises(DsrunConfigError, match=r"lr_scheduler=.*\(optimizer\) returned str"):
        dsrun.initialize(model=torch.nn.Linear(4, 1), config=CFG,
                         lr_scheduler=lambda opt: "WarmupLR")


@pytest.mark.parametrize("steps_per_print", [1000, None])
def test_backward_of_a_number_says_to_pass_the_loss_tensor(solo: None,
                                                             steps_per_print: Any) -> None:
    engine, *_ = dsrun.initialize(model=torch.nn.Linear(4, 1),
                                  config={**CFG, "steps_per_print": steps_per_print})
    loss = engine(torch.ones(2, 4)).sum()
    with pytest.raises(DsrunError, match=r"engine.backward\(\) takes the loss tensor, got "
                                         r"float .*\(not loss.item\(\)\)"):
        engine.backward(loss.item())
    engine.destroy()
