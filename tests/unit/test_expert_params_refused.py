"""A model with DeepSpeed expert parameters (``allreduce = False``, the tag
DeepSpeed's MoE layers put on experts) is refused by ``initialize()``, as
DeepSpeed 0.19.8 refuses it without expert groups: dsrun would average the
experts' gradients over every rank like a dense parameter's. A one-rank
gloo group (the check does not depend on the world size)."""

from __future__ import annotations

import pytest
import torch

import dsrun
from dsrun.errors import DsrunConfigError

LAUNCHER_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                "MASTER_PORT", "DSRUN_CONFIG")


@pytest.fixture(autouse=True)
def no_launcher(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in LAUNCHER_ENV:
        monkeypatch.delenv(key, raising=False)


def model(frozen: bool = False) -> torch.nn.Sequential:
    m = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    for p in m[1].parameters():
        p.allreduce = False  # type: ignore[attr-defined]
        p.group_name = "ep_size_2"  # type: ignore[attr-defined]
        p.requires_grad_(not frozen)
    return m


def cfg(stage: int) -> dict:
    return {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "SGD", "params": {
        "lr": 0.1}}, "zero_optimization": {"stage": stage}}


@pytest.mark.parametrize("stage", [0, 2])
@pytest.mark.parametrize("frozen", [False, True])
def test_expert_parameters_are_refused_by_name(solo: None, stage: int, frozen: bool) -> None:
    m = model(frozen)
    trained = [p for p in m.parameters() if p.requires_grad]
    with pytest.raises(DsrunConfigError) as err:
        dsrun.initialize(model=m, model_parameters=trained, config=cfg(stage))
    text = str(err.value)
    assert text.startswith("2 parameter(s) of the model passed to initialize() are DeepSpeed "
                           "expert parameters (allreduce=False): '1.weight' (expert group "
                           "'ep_size_2'), '1.bias' (expert group 'ep_size_2')")
    assert "Expert parallelism" in text and "is not implemented in dsrun" in text


def test_allreduce_true_is_a_dense_parameter(solo: None) -> None:
    m = torch.nn.Linear(4, 2)
    m.weight.allreduce = True  # type: ignore[attr-defined]
    engine, *_ = dsrun.initialize(model=m, config=cfg(0))
    engine.backward(engine(torch.ones(2, 4)).sum())
    engine.step()
