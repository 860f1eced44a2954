"""Values of the well-known optimizer and torch-scheduler params are
checked when the config is resolved (so the launcher's ``--config`` check
names FILE:LINE) and passed on as torch takes them;
what the optimizer's constructor raises for the config's params becomes a
DsrunConfigError naming ``optimizer.params`` and the config."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from dsrun.errors import DsrunConfigError, DsrunUsageError
from dsrun.launcher.configcheck import check_config
from dsrun.runtime.config import OptimizerConfig, resolve
from dsrun.runtime.lr_schedules import build_scheduler
from dsrun.runtime.optimizers import build_optimizer, optimizer_class_and_kwargs

BASE = {"train_batch_size": 2}


def config(data: Any) -> Any:
    return resolve(data, dp_size=1, dp_source="test")


def with_optimizer(kind: str, **params: Any) -> dict:
    return {**BASE, "optimizer": {"type": kind, "params": params}}


def with_scheduler(kind: str, **params: Any) -> dict:
    return {**with_optimizer("SGD", lr=0.1), "scheduler": {"type": kind, "params": params}}


@pytest.mark.parametrize("data, where, expect", [
    (with_optimizer("AdamW", lr="3e-4"), "optimizer.params.lr", "without quotes"),
    (with_optimizer("Adam", betas=[0.9]), "optimizer.params.betas", "list of 2 numbers"),
    (with_optimizer("Adam", betas=[0.9, 1.0]), "optimizer.params.betas", "in [0, 1)"),
    (with_optimizer("Lion", betas="0.9"), "optimizer.params.betas", "list of 2 numbers"),
    (with_optimizer("Adam", eps=None), "optimizer.params.eps", "a number"),
    (with_optimizer("SGD", lr=0.1, momentum=-0.5), "optimizer.params.momentum", ">= 0"),
    (with_optimizer("SGD", lr=0.1, dampening=True), "optimizer.params.dampening", "a number"),
    (with_optimizer("AdamW", weight_decay="0.01"), "optimizer.params.weight_decay",
     "without quotes"),
    (with_scheduler("StepLR", step_size="2"), "scheduler.params.step_size", "an integer"),
    (with_scheduler("StepLR", step_size=0), "scheduler.params.step_size", ">= 1"),
    (with_scheduler("StepLR", step_size=2, gamma="0.5"), "scheduler.params.gamma", "a number"),
    (with_scheduler("CosineAnnealingLR", T_max=0), "scheduler.params.T_max", "> 0"),
    (with_scheduler("CyclicLR", base_lr=0.01, max_lr=0.1, step_size_up=-1.5),
     "scheduler.params.step_size_up", "> 0"),
    (with_scheduler("LinearLR", total_iters=-1), "scheduler.params.total_iters", ">= 0"),
    # StepLR matches last_epoch % step_size == 0: 2.5 would decay every 5 steps
    (with_scheduler("StepLR", step_size=2.5), "scheduler.params.step_size", "an integer"),
    (with_scheduler("CosineAnnealingWarmRestarts", T_0=10.5), "scheduler.params.T_0",
     "an integer"),
    (with_scheduler("MultiStepLR", milestones=[2, "4"]), "scheduler.params.milestones.1",
     "an integer"),
    (with_scheduler("MultiStepLR", milestones=3), "scheduler.params.milestones",
     "list of integers"),
    (with_scheduler("OneCycleLR", max_lr="0.1", total_steps=10), "scheduler.params.max_lr",
     "list of numbers"),
])
def test_bad_values_name_the_key_and_source(data: dict, where: str, expect: str) -> None:
    with pytest.raises(DsrunConfigError) as err:
        config(data)
    text = str(err.value)
    assert f'"{where}" in config dict' in text and expect in text


def test_good_values_pass() -> None:
    c = config(with_optimizer("Adam", lr=3e-4, betas=[0.8, 0.99], eps=1e-6, weight_decay=0))
    assert dict(c.optimizer.params)["betas"] == (0.8, 0.99)
    s = config(with_scheduler("MultiStepLR", milestones=[2, 4.0], gamma=1))
    assert s.scheduler.params["milestones"] == (2, 4)
    # Adafactor's eps is a pair, not a number
    assert config(with_optimizer("Adafactor", eps=[None, 1e-3])).optimizer.type == "adafactor"


def build_and_step(data: dict) -> Any:
    """Resolve ``data``, build its optimizer and scheduler, take 3 steps."""
    c = config(data)
    optimizer = build_optimizer(c.optimizer, [torch.nn.Parameter(torch.ones(2))])
    scheduler = build_scheduler(c.scheduler, optimizer)
    for _ in range(3):
        optimizer.step()
        scheduler.step(*([1.0] if c.scheduler.type == "ReduceLROnPlateau" else []))
    return c


@pytest.mark.parametrize("kind, ints, others", [
    ("CosineAnnealingWarmRestarts", {"T_0": 10.0, "T_mult": 2.0}, {}),
    ("OneCycleLR", {"epochs": 2.0, "steps_per_epoch": 5.0}, {"max_lr": 0.1}),
    ("OneCycleLR", {"total_steps": 10.0}, {"max_lr": 0.1}),
    ("StepLR", {"step_size": 2.0, "last_epoch": -1.0}, {}),
])
def test_integral_floats_reach_torch_as_ints(kind: str, ints: dict, others: dict) -> None:
    # torch checks isinstance(T_0, int) (epochs, steps_per_epoch, total_steps
    # too): JSON's 10.0 passes the check and must not fail in every rank later
    c = build_and_step(with_scheduler(kind, **ints, **others))
    assert all(type(c.scheduler.params[key]) is int for key in ints)
    assert dict(c.scheduler.params) == {**ints, **others}


@pytest.mark.parametrize("kind, params", [
    ("CosineAnnealingLR", {"T_max": 10.5}),
    ("LinearLR", {"total_iters": 4.5}),
    ("ConstantLR", {"total_iters": 4.5}),
    ("PolynomialLR", {"total_iters": 0}),
    ("CyclicLR", {"base_lr": 0.01, "max_lr": 0.1, "step_size_up": 2.5, "step_size_down": 0}),
    ("CyclicLR", {"base_lr": 0.01, "max_lr": 0.1, "step_size_up": 2, "step_size_down": 2.5}),
    ("ReduceLROnPlateau", {"patience": 1.5, "cooldown": 0.5}),
    # torch's defaults: total_steps is enough
    ("OneCycleLR", {"max_lr": 0.1, "total_steps": 10, "epochs": None, "steps_per_epoch": None}),
])
def test_fractions_torch_computes_with_are_accepted(kind: str, params: dict) -> None:
    # torch 2.13 only computes or compares with these (CyclicLR does
    # float(step_size_up)) and DeepSpeed passes them on: they stay as written
    c = build_and_step(with_scheduler(kind, **params))
    assert {key: c.scheduler.params[key] for key in params} == params
    patience = config(with_scheduler("ReduceLROnPlateau", patience=10)).scheduler.params
    assert type(patience["patience"]) is int


def test_integer_optimizer_numbers_become_floats() -> None:
    # torch >= 2 refuses betas (0, 0.99): "betas must be either both floats or
    # both Tensors"; DeepSpeed's FusedAdam takes them
    data = with_optimizer("Adam", lr=1, betas=[0, 0.99], eps=0, weight_decay=0)
    c = config(data)
    params = dict(c.optimizer.params)
    assert params == {"lr": 1.0, "betas": (0.0, 0.99), "eps": 0.0, "weight_decay": 0.0}
    assert all(type(v) is float for v in (*params["betas"], params["lr"], params["eps"]))
    optimizer = build_optimizer(c.optimizer, [torch.nn.Parameter(torch.ones(2))])
    assert optimizer.param_groups[0]["betas"] == (0.0, 0.99)
    for kind in ("AdamW", "NAdam", "RAdam", "Adamax", "Lion", "Lamb"):
        build_optimizer(config(with_optimizer(kind, lr=0.1, betas=[0, 0])).optimizer,
                        [torch.nn.Parameter(torch.ones(2))])


def test_the_launcher_names_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(with_scheduler("StepLR", step_size="2"), indent=2))
    with pytest.raises(DsrunUsageError) as err:
        check_config(str(path), 1, {})
    assert f"{path}:12:" in str(err.value) and "scheduler.params.step_size" in str(err.value)
    path.write_text(json.dumps(with_optimizer("AdamW", lr="3e-4"), indent=2))
    with pytest.raises(DsrunUsageError, match=rf"{path}:6: .*optimizer\.params\.lr"):
        check_config(str(path), 1, {})


def test_constructor_failures_become_config_errors(tmp_path: Path) -> None:
    param = [torch.nn.Parameter(torch.ones(2))]
    # built without the config check (as from_deepspeed does): torch's IndexError
    with pytest.raises(DsrunConfigError, match=r"rejected params .*optimizer\.params.*"
                                               r"IndexError"):
        build_optimizer(OptimizerConfig("adam", {"betas": (0.9,)}), param)
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(with_optimizer("RMSprop", lr=0.1, alpha=-1.0)))
    optimizer = config(str(path)).optimizer
    with pytest.raises(DsrunConfigError, match=rf'"optimizer.params" in {path}.*alpha'):
        build_optimizer(optimizer, param)


@pytest.mark.parametrize("kind", ["Adam", "AdamW", "Lion"])
def test_set_grad_none_is_accepted_for_fused_types(kind: str) -> None:
    c = config(with_optimizer(kind, lr=0.1, set_grad_none=False))
    cls, kwargs = optimizer_class_and_kwargs(c.optimizer)
    assert "set_grad_none" not in kwargs
    build_optimizer(c.optimizer, [torch.nn.Parameter(torch.ones(2))])
    with pytest.raises(DsrunConfigError, match="set_grad_none"):
        optimizer_class_and_kwargs(OptimizerConfig(kind, {"set_grad_none": "no"}))


def test_set_grad_none_is_unknown_for_torch_types() -> None:
    with pytest.raises(DsrunConfigError, match='unknown parameter "set_grad_none"'):
        optimizer_class_and_kwargs(OptimizerConfig("sgd", {"lr": 0.1, "set_grad_none": True}))
