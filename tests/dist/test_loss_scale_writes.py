"""A script's write to the fp16 loss scale is the scale the next step uses,
at stage 0 and under ZeRO, through each of DeepSpeed's routes
(``optimizer.loss_scaler.cur_scale``, ``optimizer.cur_scale``,
``optimizer.loss_scale``), on a one-rank engine in this process.

The model's gradient is 4 per weight: at the initial scale 2^16 the scaled
fp16 gradient overflows (the step is skipped), at a written scale of 8 it
does not, and the weights move by exactly ``lr * 4`` (unscaled by the
same scale). A written scale no backward has used yet is the one a
checkpoint saves, and a load that leaves the optimizer states (the
scaler) keeps it, at stage 0 as under ZeRO."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import dsrun
from dsrun.errors import DsrunError

pytestmark = pytest.mark.dist

LR = 0.25
ROUTES = ("loss_scaler.cur_scale", "cur_scale", "loss_scale")


def build(stage: int, precision: str = "fp16") -> dsrun.DsrunEngine:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1, bias=False)
    engine, _, _, _ = dsrun.initialize(model=model, config={
        "train_micro_batch_size_per_gpu": 1, "gradient_clipping": 0,
        "optimizer": {"type": "SGD", "params": {"lr": LR}},
        precision: {"enabled": True, "initial_scale_power": 16} if precision == "fp16"
        else {"enabled": True},
        "zero_optimization": {"stage": stage}})
    return engine


def weight(engine: dsrun.DsrunEngine) -> torch.Tensor:
    return dsrun.utils.safe_get_full_fp32_param(engine.module.weight).detach().clone()


def train_step(engine: dsrun.DsrunEngine) -> None:
    x = torch.full((1, 4), 4.0, dtype=torch.half)
    engine.backward(engine(x).float().sum())
    engine.step()


def read(optimizer: object, route: str) -> float:
    if route == "loss_scaler.cur_scale":
        return optimizer.loss_scaler.cur_scale  # type: ignore[attr-defined]
    return getattr(optimizer, route)


def write(optimizer: object, route: str, value: float) -> None:
    if route == "loss_scaler.cur_scale":
        optimizer.loss_scaler.cur_scale = value  # type: ignore[attr-defined]
    else:
        setattr(optimizer, route, value)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("route", ROUTES)
def test_a_written_scale_is_the_one_the_next_step_uses(solo: None, stage: int,
                                                        route: str) -> None:
    engine = build(stage)
    opt = engine.optimizer
    assert read(opt, route) == 2.0**16
    train_step(engine)  # 4 * 2^16 overflows fp16: skipped (hysteresis keeps the scale)
    assert engine.skipped_steps == 1 and opt.cur_scale == 2.0**16
    before = weight(engine)
    write(opt, route, 8.0)
    train_step(engine)
    assert engine.was_step_applied() and engine.skipped_steps == 1, route
    assert torch.allclose(weight(engine), before - LR * 4.0, atol=2e-3)
    assert opt.loss_scaler.cur_scale == opt.cur_scale == opt.loss_scale == 8.0
    assert engine.precision.loss_scale == 8.0


@pytest.mark.parametrize("stage", [0, 2])
def test_the_scaler_state_reads_and_writes_under_deepspeed_names(solo: None,
                                                                 stage: int) -> None:
    engine = build(stage)
    scaler = engine.optimizer.loss_scaler
    assert (scaler.cur_iter, scaler.last_overflow_iter, scaler.cur_hysteresis) == (0, -1, 2)
    assert (scaler.delayed_shift, scaler.scale_window, scaler.dynamic) == (2, 1000, True)
    assert scaler.raise_error_at_min_scale and not scaler.consecutive_hysteresis
    scaler.cur_hysteresis = 1  # no hysteresis left: the first overflow halves the scale
    scaler.cur_scale = 2.0**17
    train_step(engine)
    assert engine.optimizer.cur_scale == 2.0**16 and scaler.cur_iter == 1
    assert scaler.last_overflow_iter == 0 and scaler.loss_scale == 2.0**16


def test_a_bad_scale_is_refused_by_name(solo: None) -> None:
    engine = build(2)
    with pytest.raises(ValueError, match=r"optimizer.cur_scale = 0\.0"):
        engine.optimizer.cur_scale = 0.0
    with pytest.raises(ValueError, match=r"loss_scaler.cur_scale = inf"):
        engine.optimizer.loss_scaler.cur_scale = float("inf")
    assert engine.optimizer.cur_scale == 2.0**16


def test_a_bad_scale_written_at_stage0_is_refused_at_the_next_backward(solo: None) -> None:
    engine = build(0)
    engine.optimizer.loss_scale = -1.0
    with pytest.raises(ValueError, match=r"optimizer.loss_scale = -1\.0"):
        train_step(engine)


def test_bf16_zero_refuses_a_scale_write(solo: None) -> None:
    engine = build(1, precision="bf16")
    assert engine.optimizer.cur_scale == 1.0
    with pytest.raises(DsrunError, match=r"optimizer.loss_scale = 8.0: this model has no loss"):
        engine.optimizer.loss_scale = 8.0


@pytest.mark.parametrize("stage", [0, 2])
def test_a_written_scale_not_yet_used_is_saved(solo: None, tmp_path: Path,
                                               stage: int) -> None:
    engine = build(stage)
    train_step(engine)
    engine.optimizer.cur_scale = 8.0
    engine.save_checkpoint(str(tmp_path), tag="t")
    assert engine.precision.loss_scale == 8.0
    resumed = build(stage)
    resumed.load_checkpoint(str(tmp_path), tag="t")
    assert resumed.precision.loss_scale == resumed.optimizer.cur_scale == 8.0


@pytest.mark.parametrize("stage", [0, 2])
def test_a_load_without_optimizer_states_keeps_a_written_scale(solo: None, tmp_path: Path,
                                                                stage: int) -> None:
    build(stage).save_checkpoint(str(tmp_path), tag="t")  # saved at 2^16
    engine = build(stage)
    engine.optimizer.loss_scale = 8.0
    engine.load_checkpoint(str(tmp_path), tag="t", load_optimizer_states=False)
    assert engine.precision.loss_scale == engine.optimizer.cur_scale == 8.0
    engine.load_checkpoint(str(tmp_path), tag="t")  # the saved scaler replaces it
    assert engine.precision.loss_scale == engine.optimizer.cur_scale == 2.0**16
