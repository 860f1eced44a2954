"""initialize() refuses optimizer param groups that do not match the
module at ZeRO stages 0-2: a parameter listed twice (stepped twice per step
at stage 0; DeepSpeed refuses it at every stage) and tensors that are not
the module's (another copy of the model: its tensors were stepped, the
module's gradients never applied, with no message). Stage 3 refuses both
itself, in the same words. World-size-1 gloo group over a HashStore."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist

import dsrun
from dsrun.errors import DsrunConfigError
from dsrun.runtime.env import DistEnv

# torch warns when it builds an optimizer with a parameter twice: the point here
pytestmark = pytest.mark.filterwarnings(
    "ignore:optimizer contains a parameter group with duplicate parameters")


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


def _net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))


def _config(stage: int, **extra: Any) -> dict:
    return {"train_micro_batch_size_per_gpu": 1, "steps_per_print": 1000,
            "zero_optimization": {"stage": stage},
            "optimizer": {"type": "SGD", "params": {"lr": 0.1}}, **extra}


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_a_parameter_listed_twice_is_refused(solo: None, stage: int) -> None:
    model = _net()
    with pytest.raises(DsrunConfigError, match=r"param group 0, parameter 1 \(shape \(8, 4\)\) "
                                               "appears in more than one place"):
        dsrun.initialize(model=model, config=_config(stage),
                         model_parameters=[model[0].weight, model[0].weight])


def test_a_client_optimizer_with_a_parameter_twice_is_refused_at_stage_0(solo: None) -> None:
    model = _net()
    client = torch.optim.AdamW(list(model.parameters()) + [model[2].weight], lr=0.1)
    with pytest.raises(DsrunConfigError, match=r"parameter 4 .*more than one place.*'2\.weight'"):
        dsrun.initialize(model=model, config=_config(0), optimizer=client)


def test_fp16_at_stage_0_refuses_a_duplicate_too(solo: None) -> None:
    model = _net()
    with pytest.raises(DsrunConfigError, match="appears in more than one place"):
        dsrun.initialize(model=model, config=_config(0, fp16={"enabled": True}),
                         model_parameters=[model[0].weight, model[0].weight])


def _foreign_match(count: int, shape: str, stage: int) -> str:
    return (rf"{count} tensor\(s\) in the optimizer's param groups are not parameters of the "
            rf"module .*param group 0, parameter 0 \(shape \({shape}\)\) is not a parameter of "
            rf"the module.*: ZeRO stage {stage}")


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_parameters_of_a_copy_of_the_model_are_refused(solo: None, stage: int) -> None:
    model = _net()
    params = copy.deepcopy(model).parameters()
    with pytest.raises(DsrunConfigError, match=_foreign_match(4, "8, 4", stage)) as err:
        dsrun.initialize(model=model, config=_config(stage), model_parameters=params)
    assert "('0.weight' has that shape: a copy of it?)" in str(err.value)


@pytest.mark.parametrize("stage", [0, 2])
def test_a_client_optimizer_over_other_tensors_is_refused(solo: None, stage: int) -> None:
    model = _net()
    other = torch.nn.Parameter(torch.zeros(3))
    with pytest.raises(DsrunConfigError, match=_foreign_match(1, "3,", stage)):
        dsrun.initialize(model=model, config=_config(stage),
                         optimizer=torch.optim.SGD([other], lr=0.1))


def test_extra_tensors_beside_the_modules_at_stage_0_are_stepped_with_a_warning(
        solo: None, caplog: pytest.LogCaptureFixture) -> None:
    """A learnable loss temperature next to the model's parameters: DeepSpeed's
    stage 0 steps it too (with each rank's own gradient)."""
    model = _net()
    temperature = torch.nn.Parameter(torch.ones(1))
    optimizer = torch.optim.SGD([*model.parameters(), temperature], lr=0.1)
    engine, *_ = dsrun.initialize(model=model, config=_config(0), optimizer=optimizer)
    assert "1 tensor(s) in the optimizer's param groups are not parameters of the module, " \
           "e.g. param group 0, parameter 4 (shape (1,))" in caplog.text
    x = torch.ones(2, 4)
    loss = engine(x).sum() * temperature
    engine.backward(loss)
    engine.step()
    assert temperature.item() != 1.0
    engine.destroy()


def test_part_of_the_model_is_fine(solo: None) -> None:
    model = _net()
    engine, optimizer, *_ = dsrun.initialize(model=model, config=_config(0),
                                             model_parameters=model[2].parameters())
    assert [p.shape for p in optimizer.param_groups[0]["params"]] == [(1, 8), (1,)]


@pytest.mark.parametrize("stage", [1, 2])
def test_extra_tensors_beside_the_modules_at_zero_1_2_are_refused_saying_why(
        solo: None, stage: int) -> None:
    model = _net()
    optimizer = torch.optim.SGD([*model.parameters(), torch.nn.Parameter(torch.ones(1))], lr=0.1)
    with pytest.raises(DsrunConfigError, match=rf"ZeRO stage {stage} steps the module's "
                                               r"parameters only \(make extra tensors") as err:
        dsrun.initialize(model=model, config=_config(stage), optimizer=optimizer)
    assert "the module never" not in str(err.value)
