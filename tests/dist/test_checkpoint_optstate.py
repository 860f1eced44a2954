"""Optimizer state across checkpoints at world size 1, in this process:
0-d parameters, parameters frozen when saved and trainable when loaded,
failures while installing the state, and client LR scheduler factories.

The 2-rank versions (where some ranks would fail and others hang) are in
``workers/checkpoint_cases.py``'s extras.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest
import torch

import dsrun
from dsrun.errors import CheckpointError
from dsrun.runtime.checkpoint import fragments, sources
from tests.dist.test_checkpoint_world1 import assert_same, snapshot

pytestmark = pytest.mark.dist


class Scaled(torch.nn.Module):
    """Two linear layers and a 0-d parameter (a learned scale)."""

    def __init__(self, freeze_first: bool = False) -> None:
        super().__init__()
        self.first = torch.nn.Linear(4, 6)
        self.second = torch.nn.Linear(6, 3)
        self.scale = torch.nn.Parameter(torch.tensor(1.5))
        if freeze_first:
            self.first.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.second(torch.tanh(self.first(x))) * self.scale).square().mean()


def build(stage: int, seed: int = 0, freeze_first: bool = False, **config: Any) -> Any:
    torch.manual_seed(seed)
    cfg = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 1000,
           "optimizer": {"type": "Adam", "params": {"lr": 0.01}},
           "zero_optimization": {"stage": stage}, **config}
    engine, *_ = dsrun.initialize(model=Scaled(freeze_first), config=cfg)
    return engine


def train(engine: Any, start: int, steps: int) -> list[float]:
    losses = []
    for step in range(start, start + steps):
        x = torch.randn(2, 4, generator=torch.Generator().manual_seed(step))
        loss = engine(x)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def inner(engine: Any) -> torch.optim.Optimizer:
    return engine.optimizer.optimizer if engine.zero_stage else engine.optimizer


# ----------------------------------------------------------- 0-d parameters


@pytest.mark.parametrize("saved, loaded", [(0, 1), (0, 2), (0, 3), (3, 0), (0, 0)])
def test_a_scalar_parameter_keeps_its_adam_moments(solo: None, tmp_path: Path,
                                                   saved: int, loaded: int) -> None:
    engine = build(saved)
    train(engine, 0, 2)
    engine.save_checkpoint(tmp_path, tag="t")
    expected = train(engine, 2, 3)
    manifest = json.loads((tmp_path / "t" / "manifest.json").read_text())
    scale = manifest["tensors"]["scale"]
    assert set(scale["items"]) == {"value", "exp_avg", "exp_avg_sq"}
    assert set(scale["scalars"]) == {"step"}
    other = build(loaded, seed=5)
    other.load_checkpoint(tmp_path, tag="t")
    assert train(other, 2, 3) == pytest.approx(expected, rel=1e-6, abs=1e-7)


def _legacy_split(state: Any, shape: Any, where: str) -> Any:
    """What saves did before 0-d state was told apart: every 0-d tensor a scalar."""
    elementwise, scalars = {}, {}
    for key, value in state.items():
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            elementwise[key] = value.detach().view(-1)
        else:
            scalars[key] = value
    return elementwise, scalars


@pytest.mark.parametrize("loaded", [0, 2])
def test_checkpoints_of_earlier_versions_load_a_scalar_parameters_moments(
        solo: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, loaded: int) -> None:
    engine = build(0)
    train(engine, 0, 2)
    with monkeypatch.context() as patch:
        patch.setattr(sources, "split_state", _legacy_split)
        engine.save_checkpoint(tmp_path, tag="old")
    manifest = json.loads((tmp_path / "old" / "manifest.json").read_text())
    assert set(manifest["tensors"]["scale"]["scalars"]) == {"step", "exp_avg", "exp_avg_sq"}
    expected = train(engine, 2, 3)
    other = build(loaded, seed=5)
    other.load_checkpoint(tmp_path, tag="old")
    assert train(other, 2, 3) == pytest.approx(expected, rel=1e-6, abs=1e-7)


def test_split_state_tells_a_scalar_parameters_moments_from_step() -> None:
    state = {"step": torch.tensor(3.0), "exp_avg": torch.tensor(0.5),
             "mu_product": torch.tensor(1.0)}
    elementwise, scalars = fragments.split_state(state, (), "scale")
    assert set(elementwise) == {"exp_avg"} and elementwise["exp_avg"].shape == (1,)
    assert set(scalars) == {"step", "mu_product"}
    elementwise, scalars = fragments.split_state(state, (1,), "piece")
    assert not elementwise and set(scalars) == set(state)


# ------------------------------------------- frozen when saved, trained now


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_parameters_frozen_when_saved_get_fresh_optimizer_state(
        solo: None, tmp_path: Path, stage: int, caplog: pytest.LogCaptureFixture) -> None:
    engine = build(stage, freeze_first=True)
    train(engine, 0, 2)
    engine.save_checkpoint(tmp_path, tag="t")
    saved = {n: p.detach().clone() for n, p in engine.module.named_parameters()} \
        if stage < 3 else None
    other = build(stage, seed=5)
    with caplog.at_level(logging.INFO, logger="dsrun.runtime.checkpoint"):
        other.load_checkpoint(tmp_path, tag="t")
    assert "no optimizer state for 2 trainable parameters" in caplog.text
    assert "first.bias, first.weight" in caplog.text
    if saved is not None:
        for name, p in other.module.named_parameters():
            assert torch.equal(p.detach(), saved[name]), name
    states = list(inner(other).state.values())
    assert states and all(float(s["step"]) == 2 for s in states)  # second's state was loaded
    losses = train(other, 2, 3)
    assert all(torch.isfinite(torch.tensor(losses)))
    grown = [p for n, p in other.module.named_parameters() if n.startswith("first")]
    assert grown and all(p.requires_grad for p in grown)


def test_a_state_the_optimizer_refuses_fails_before_anything_changes(
        solo: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    engine = build(2)
    train(engine, 0, 2)
    engine.save_checkpoint(tmp_path, tag="t")
    other = build(2, seed=5)
    train(other, 0, 1)
    before = snapshot(other)

    def refuse(self: Any, state: Any) -> None:
        raise KeyError("step")

    monkeypatch.setattr(torch.optim.Adam, "__setstate__", refuse)
    with pytest.raises(CheckpointError, match="failed on rank 0: KeyError"):
        other.load_checkpoint(tmp_path, tag="t")
    monkeypatch.undo()
    assert_same(before, snapshot(other))


# ------------------------------------------------ client scheduler factories


def full(engine: Any) -> dict[str, torch.Tensor]:
    state = engine.optimizer.module_state_dict() if engine.zero_stage == 3 else \
        engine.module.state_dict()
    return {k: v.detach().clone() for k, v in state.items()}


OFFLOAD = {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}


@pytest.mark.parametrize("stage, extra", [(0, {}), (1, {}), (2, {}), (3, {}), (2, OFFLOAD)])
def test_a_scheduler_factory_gets_the_optimizer_that_steps(solo: None, tmp_path: Path,
                                                          stage: int, extra: Any) -> None:
    def after_one_step(optimizer: torch.optim.Optimizer) -> Any:
        assert isinstance(optimizer, torch.optim.Optimizer)
        return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 if s == 0 else 0.0)

    def halving(optimizer: torch.optim.Optimizer) -> Any:
        return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 0.5 ** s)

    def engine_with(factory: Any, seed: int) -> Any:
        torch.manual_seed(seed)
        cfg = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 1000,
               "optimizer": {"type": "Adam", "params": {"lr": 0.01}},
               "zero_optimization": {"stage": stage}, **extra}
        engine, _, _, sched = dsrun.initialize(model=Scaled(), config=cfg, lr_scheduler=factory)
        assert sched is engine.lr_scheduler
        return engine

    engine = engine_with(after_one_step, 0)
    start = full(engine)
    train(engine, 0, 1)
    once = full(engine)
    assert engine.get_lr() == [0.0]
    train(engine, 1, 2)  # lr 0 from the schedule: no change
    assert all(torch.equal(once[k], v) for k, v in full(engine).items())
    assert not all(torch.equal(once[k], v) for k, v in start.items())

    engine = engine_with(halving, 0)
    train(engine, 0, 2)
    engine.save_checkpoint(tmp_path, tag="t")
    other = engine_with(halving, 3)
    other.load_checkpoint(tmp_path, tag="t")
    assert other.lr_scheduler.state_dict() == engine.lr_scheduler.state_dict()
    assert other.get_lr() == engine.get_lr() == [0.01 * 0.25]
    assert train(other, 2, 2) == pytest.approx(train(engine, 2, 2), rel=1e-6)
