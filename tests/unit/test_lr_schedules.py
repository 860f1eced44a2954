"""DeepSpeed LR schedules: curves against their formulas, protocol, state."""

from __future__ import annotations

import logging
import math
from typing import Any

import pytest
import torch

from dsrun.errors import DsrunConfigError
from dsrun.runtime import lr_schedules as ls
from dsrun.runtime.config import resolve
from dsrun.runtime.lr_schedules import (
    LRRangeTest,
    OneCycle,
    WarmupCosineLR,
    WarmupDecayLR,
    WarmupLR,
    build_scheduler,
)


def make_opt(kind: str = "adamw", lr: float = 0.1, groups: int = 1) -> torch.optim.Optimizer:
    params = [{"params": [torch.nn.Parameter(torch.zeros(2))]} for _ in range(groups)]
    if kind == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=0.5)
    return torch.optim.AdamW(params, lr=lr)


def curve(scheduler: Any, optimizer: torch.optim.Optimizer, steps: int) -> list[float]:
    """lr in force for optimizer steps 0..steps-1 (value after step(t) = iteration t)."""
    out = []
    for _ in range(steps):
        scheduler.step()
        out.append(optimizer.param_groups[0]["lr"])
    return out


# --------------------------------------------------------------- WarmupLR

W, LO, HI = 10, 0.01, 0.1


@pytest.mark.parametrize("t", [0, 1, 4, W - 1, W, W + 5, 100])
def test_warmup_lr_log_curve(t: int) -> None:
    opt = make_opt()
    lrs = curve(WarmupLR(opt, LO, HI, W, "log"), opt, 101)
    expected = LO + (HI - LO) * (math.log(t + 1) / math.log(W)) if t < W else HI
    assert lrs[t] == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("t", [0, 3, W - 1, W, 50])
def test_warmup_lr_linear_curve(t: int) -> None:
    opt = make_opt()
    lrs = curve(WarmupLR(opt, LO, HI, W, "linear"), opt, 51)
    expected = LO + (HI - LO) * t / W if t < W else HI
    assert lrs[t] == pytest.approx(expected, rel=1e-12)


def test_warmup_lr_construction_sets_min_and_max_defaults_to_optimizer_lr() -> None:
    opt = make_opt(lr=0.3)
    sched = WarmupLR(opt, warmup_min_lr=0.02, warmup_num_steps=4, warmup_type="linear")
    assert opt.param_groups[0]["lr"] == 0.02 and sched.get_last_lr() == [0.02]
    assert curve(sched, opt, 6)[-1] == pytest.approx(0.3)


def test_warmup_num_steps_is_at_least_two() -> None:
    opt = make_opt()
    lrs = curve(WarmupLR(opt, 0.0, 1.0, warmup_num_steps=1, warmup_type="log"), opt, 3)
    assert lrs == pytest.approx([0.0, math.log(2) / math.log(2), 1.0])


# ---------------------------------------------------------- WarmupDecayLR

T = 50


@pytest.mark.parametrize("t", [0, 5, W - 1, W, 30, T - 1, T, T + 10])
def test_warmup_decay_curve(t: int) -> None:
    opt = make_opt()
    lrs = curve(WarmupDecayLR(opt, T, LO, HI, W, "linear"), opt, T + 11)
    if t < W:
        gamma = t / W
    else:
        gamma = max(0.0, (T - t) / max(1.0, T - W))
    assert lrs[t] == pytest.approx(LO + (HI - LO) * gamma, rel=1e-12)


def test_warmup_decay_landmarks() -> None:
    opt = make_opt()
    lrs = curve(WarmupDecayLR(opt, T, 0.0, HI, W, "linear"), opt, T + 2)
    assert lrs[0] == 0.0
    assert lrs[W] == pytest.approx(HI)  # end of warmup: the peak
    assert lrs[30] == pytest.approx(HI * 20 / 40)  # mid-decay
    assert lrs[T] == 0.0 and lrs[T + 1] == 0.0  # end: the minimum, and it stays there


def test_warmup_decay_warns_when_total_is_below_warmup(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        WarmupDecayLR(make_opt(), total_num_steps=5, warmup_num_steps=10)
    assert "less than warmup_num_steps" in caplog.text


# --------------------------------------------------------- WarmupCosineLR


def cosine_ratio(t: int, total: int, warmup: int, min_ratio: float, cos_min: float) -> float:
    if t < warmup:
        return min_ratio + (1 - min_ratio) * math.log(t + 1) / math.log(warmup)
    progress = min(1.0, (t - warmup + 1) / max(1, total - warmup))
    return max(0.0, cos_min + (1 - cos_min) * 0.5 * (1 + math.cos(math.pi * progress)))


@pytest.mark.parametrize("t", [0, 4, W - 1, W, 25, 30, T - 1, T, T + 20])
def test_warmup_cosine_curve(t: int) -> None:
    opt = make_opt(lr=0.2)
    lrs = curve(WarmupCosineLR(opt, T, 0.1, W, 0.01, "log"), opt, T + 21)
    assert lrs[t] == pytest.approx(0.2 * cosine_ratio(t, T, W, 0.1, 0.01), rel=1e-12)


def test_warmup_cosine_landmarks() -> None:
    opt = make_opt(lr=1.0)
    sched = WarmupCosineLR(opt, total_num_steps=21, warmup_num_steps=11, cos_min_ratio=0.0,
                           warmup_type="linear")
    assert opt.param_groups[0]["lr"] == 0.0  # construction: ratio 0 (DeepSpeed)
    lrs = curve(sched, opt, 30)
    assert lrs[0] == 0.0
    assert lrs[15] == pytest.approx(0.5)  # p = 5/10: half way down the cosine
    assert lrs[20] == pytest.approx(0.0, abs=1e-15)
    assert lrs[29] == pytest.approx(0.0, abs=1e-15)  # clamped after the end, no rise


def test_warmup_cosine_scales_each_group_lr() -> None:
    opt = torch.optim.SGD([{"params": [torch.nn.Parameter(torch.zeros(1))], "lr": 1.0},
                           {"params": [torch.nn.Parameter(torch.zeros(1))], "lr": 3.0}], lr=1.0)
    sched = WarmupCosineLR(opt, total_num_steps=10, warmup_num_steps=2)
    sched.step(5)
    assert sched.get_last_lr()[1] == pytest.approx(3 * sched.get_last_lr()[0])


# --------------------------------------------------------------- OneCycle


def test_one_cycle_triangle_decay_and_momentum() -> None:
    opt = make_opt()
    sched = OneCycle(opt, cycle_min_lr=0.01, cycle_max_lr=0.05, cycle_first_step_size=4,
                     cycle_second_step_size=6, decay_step_size=2, decay_lr_rate=0.5,
                     cycle_min_mom=0.85, cycle_max_mom=0.95)
    assert opt.param_groups[0]["lr"] == 0.01
    assert opt.param_groups[0]["betas"] == (0.85, 0.99)
    lrs, moms = [], []
    for _ in range(16):
        sched.step()
        lrs.append(opt.param_groups[0]["lr"])
        moms.append(opt.param_groups[0]["betas"])
    for t in range(10):  # inside the cycle; iteration t + 1 of 10
        x = (t + 1) / 10
        scale = x / 0.4 if x <= 0.4 else (x - 1) / (0.4 - 1)
        assert lrs[t] == pytest.approx(0.01 + 0.04 * scale), t
        assert moms[t] == pytest.approx((0.95 - 0.10 * scale, 0.99)), t
    assert lrs[3] == pytest.approx(0.05)  # the peak at the end of the first half
    assert lrs[9] == pytest.approx(0.01)  # back to the minimum at the end of the cycle
    for t in range(10, 16):  # decay: min / (1 + rate * k / size), k = t - 10 + 1
        assert lrs[t] == pytest.approx(0.01 / (1 + 0.5 * (t - 9) / 2)), t
        assert moms[t] == (0.95, 0.99)


def test_one_cycle_stairs() -> None:
    opt = make_opt()
    sched = OneCycle(opt, 0.0, 1.0, cycle_first_step_size=4, cycle_first_stair_count=2,
                     cycle_momentum=False)
    assert curve(sched, opt, 8) == pytest.approx([0.0, 0.5, 0.5, 1.0, 0.5, 0.5, 0.0, 0.0])


def test_one_cycle_momentum_decay_and_sgd_without_betas(
        caplog: pytest.LogCaptureFixture) -> None:
    lr, mom = ls.one_cycle_at(13, cycle_min_lr=0.1, cycle_max_lr=1.0, cycle_first_step_size=5,
                              decay_step_size=4, decay_mom_rate=0.1)
    assert (lr, mom) == pytest.approx((0.1, 0.9 * (1 + 0.1 * 4 / 4)))
    opt = make_opt("sgd")
    with caplog.at_level(logging.WARNING):
        sched = OneCycle(opt, 0.1, 1.0, cycle_first_step_size=2)
    assert "cycle_momentum is disabled" in caplog.text
    sched.step()
    assert "betas" not in opt.param_groups[0] and opt.param_groups[0]["momentum"] == 0.5


# ------------------------------------------------------------ LRRangeTest


@pytest.mark.parametrize(("staircase", "expected"), [
    (False, [0.1 * (1 + 2 * (t + 1) / 3) for t in range(6)]),
    (True, [0.1 * (1 + 2 * ((t + 1) // 3)) for t in range(6)]),
])
def test_lr_range_test(staircase: bool, expected: list[float]) -> None:
    opt = make_opt()
    sched = LRRangeTest(opt, 0.1, lr_range_test_step_size=3, lr_range_test_step_rate=2.0,
                        lr_range_test_staircase=staircase)
    assert opt.param_groups[0]["lr"] == 0.1
    assert curve(sched, opt, 6) == pytest.approx(expected)


# --------------------------------------------------------- pure = classes


@pytest.mark.parametrize(("cls", "kwargs", "pure"), [
    (WarmupLR, dict(warmup_min_lr=0.01, warmup_max_lr=0.2, warmup_num_steps=7),
     lambda t: ls.warmup_lr_at(t, warmup_min_lr=0.01, warmup_max_lr=0.2, warmup_num_steps=7)),
    (WarmupDecayLR, dict(total_num_steps=30, warmup_num_steps=7, warmup_max_lr=0.2),
     lambda t: ls.warmup_decay_lr_at(t, total_num_steps=30, warmup_num_steps=7,
                                     warmup_max_lr=0.2)),
    (WarmupCosineLR, dict(total_num_steps=30, warmup_num_steps=7),
     lambda t: 0.1 * ls.warmup_cosine_ratio_at(t, total_num_steps=30, warmup_num_steps=7)),
    (OneCycle, dict(cycle_min_lr=0.01, cycle_max_lr=0.3, cycle_first_step_size=6,
                    decay_step_size=3, decay_lr_rate=0.2),
     lambda t: ls.one_cycle_at(t, cycle_min_lr=0.01, cycle_max_lr=0.3, cycle_first_step_size=6,
                               decay_step_size=3, decay_lr_rate=0.2)[0]),
    (LRRangeTest, dict(lr_range_test_min_lr=0.01, lr_range_test_step_size=4),
     lambda t: ls.lr_range_test_lr_at(t, lr_range_test_min_lr=0.01, lr_range_test_step_size=4)),
])
def test_classes_follow_their_pure_functions(cls: Any, kwargs: dict, pure: Any) -> None:
    opt = make_opt(lr=0.1)
    sched = cls(opt, **kwargs)
    assert opt.param_groups[0]["lr"] == pytest.approx(pure(-1))
    assert curve(sched, opt, 40) == pytest.approx([pure(t) for t in range(40)])


# ---------------------------------------------------------------- protocol


def test_step_jumps_state_dict_round_trip_and_resume() -> None:
    opt = make_opt()
    sched = WarmupDecayLR(opt, 40, 0.0, 0.1, 10, "linear")
    curve(sched, opt, 15)
    state = sched.state_dict()
    assert state == {"last_batch_iteration": 14}
    expected = curve(sched, opt, 5)

    opt2 = make_opt()
    resumed = WarmupDecayLR(opt2, 40, 0.0, 0.1, 10, "linear", last_batch_iteration=3)
    assert opt2.param_groups[0]["lr"] == 0.1  # resuming leaves the optimizer alone
    with pytest.raises(RuntimeError, match="step"):
        resumed.get_last_lr()
    resumed.load_state_dict(state)
    assert curve(resumed, opt2, 5) == pytest.approx(expected)

    sched.step(12)  # DeepSpeed's step(last_batch_iteration)
    assert sched.last_batch_iteration == 12 and sched.last_epoch == 12
    assert sched.get_last_lr() == pytest.approx([0.1 * 28 / 30])


def test_per_group_values_and_tensor_lrs() -> None:
    opt = make_opt(groups=2)
    opt.param_groups[1]["lr"] = torch.tensor(0.1)
    sched = WarmupLR(opt, warmup_min_lr=[0.0, 0.1], warmup_max_lr=[1.0, 2.0],
                     warmup_num_steps=4, warmup_type="linear")
    sched.step(2)
    assert sched.get_last_lr() == pytest.approx([0.5, 1.05])
    assert isinstance(opt.param_groups[1]["lr"], torch.Tensor)
    assert float(opt.param_groups[1]["lr"]) == pytest.approx(1.05)
    with pytest.raises(DsrunConfigError, match="2 param groups"):
        WarmupLR(opt, warmup_min_lr=[0.0, 0.1, 0.2])


def test_is_a_torch_scheduler_and_unwraps_wrapped_optimizers() -> None:
    class Wrapper:
        def __init__(self, inner: torch.optim.Optimizer) -> None:
            self.optimizer = inner

    opt = make_opt()
    sched = WarmupLR(Wrapper(opt), warmup_max_lr=0.5, warmup_num_steps=2)  # type: ignore[arg-type]
    assert isinstance(sched, torch.optim.lr_scheduler.LRScheduler)
    assert sched.optimizer is opt
    with pytest.raises(TypeError):
        WarmupLR(object())  # type: ignore[arg-type]


@pytest.mark.parametrize(("build", "fragment"), [
    (lambda o: WarmupLR(o, warmup_num_steps=0), "warmup_num_steps"),
    (lambda o: WarmupLR(o, warmup_type="cos"), "warmup_type"),
    (lambda o: WarmupDecayLR(o, total_num_steps=-1), "total_num_steps"),
    (lambda o: WarmupCosineLR(o, total_num_steps=10, warmup_num_steps=2.5), "warmup_num_steps"),
    (lambda o: OneCycle(o, 0.1, 1.0, cycle_first_step_size=0), "cycle_first_step_size"),
    (lambda o: LRRangeTest(o, lr_range_test_step_size=0), "lr_range_test_step_size"),
])
def test_invalid_arguments(build: Any, fragment: str) -> None:
    with pytest.raises(DsrunConfigError, match=fragment):
        build(make_opt())


def test_build_scheduler_from_a_resolved_config() -> None:
    config = resolve({"train_batch_size": 4,
                      "optimizer": {"type": "AdamW", "params": {"lr": 0.2}},
                      "scheduler": {"type": "WarmupDecayLR", "params": {
                          "warmup_max_lr": "auto", "warmup_num_steps": 5,
                          "warmup_type": "linear", "total_num_steps": "auto"}}},
                     dp_size=1, dp_source="test", total_num_steps=25, environ={})
    opt = make_opt()
    sched = build_scheduler(config.scheduler, opt)
    assert isinstance(sched, WarmupDecayLR)
    assert curve(sched, opt, 6)[-1] == pytest.approx(0.2 * 20 / 20)
    assert build_scheduler(None, opt) is None
    listed = resolve({"train_batch_size": 4, "scheduler": {"type": "WarmupLR", "params": {
        "warmup_max_lr": [0.1, 0.2]}}}, dp_size=1, dp_source="test", environ={})
    assert isinstance(build_scheduler(listed.scheduler, make_opt(groups=2)), WarmupLR)
