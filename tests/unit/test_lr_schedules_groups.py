"""LR schedules per param group, torch schedulers named in a config, and
schedulers the engine must not step (ReduceLROnPlateau).

Expected DeepSpeed values were computed once with DeepSpeed 0.19.8's own
``deepspeed.runtime.lr_schedules`` (bench/.venv-ds) over a torch Adam with
two param groups (lr 0.01 and 0.003), stepping the scheduler and reading
each group's ``lr``/``betas`` after every ``step()``; they are pasted here
as constants (dsrun's differ from them by at most 1 ulp: the same formula
evaluated in another order).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from dsrun.errors import DsrunConfigError
from dsrun.runtime.config import SchedulerConfig, resolve
from dsrun.runtime.lr_schedules import (
    OneCycle,
    WarmupLR,
    build_scheduler,
    needs_lr_kwargs,
    needs_metric,
    scheduler_step_args,
    takes_an_argument,
)

# torch's schedulers warn when stepped before their optimizer: here nothing trains
pytestmark = pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step")


def two_groups() -> torch.optim.Optimizer:
    a, b = torch.nn.Parameter(torch.zeros(1)), torch.nn.Parameter(torch.zeros(1))
    return torch.optim.Adam([{"params": [a], "lr": 0.01}, {"params": [b], "lr": 0.003}])


def lrs(scheduler: Any, optimizer: torch.optim.Optimizer, steps: int) -> list[list[float]]:
    out = []
    for _ in range(steps):
        scheduler.step()
        out.append([g["lr"] for g in optimizer.param_groups])
    return out


# ------------------------------------------------------------ WarmupLR

def test_warmup_lr_without_max_warms_each_group_to_its_own_lr() -> None:
    opt = two_groups()
    sched = WarmupLR(opt, warmup_num_steps=3)
    assert [g["lr"] for g in opt.param_groups] == [0.0, 0.0]
    # DeepSpeed 0.19.8: WarmupLR(opt, warmup_num_steps=3), 5 steps
    expected = [[0.0, 0.0], [0.0063092975357145736, 0.001892789260714372],
                [0.01, 0.003], [0.01, 0.003], [0.01, 0.003]]
    assert lrs(sched, opt, 5) == [pytest.approx(row, rel=1e-15) for row in expected]


def test_warmup_lr_from_a_config_without_max_keeps_group_ratios() -> None:
    config = resolve({"train_batch_size": 1, "scheduler": {
        "type": "WarmupLR", "params": {"warmup_num_steps": 2}}},
        dp_size=1, dp_source="test", environ={})
    opt = two_groups()
    sched = build_scheduler(config.scheduler, opt)
    assert lrs(sched, opt, 3)[-1] == [0.01, 0.003]


# ------------------------------------------------------------ OneCycle

# DeepSpeed 0.19.8: OneCycle(opt, cycle_min_lr=[0.001, 0.0005], cycle_max_lr=[0.01, 0.004],
# cycle_first_step_size=3, cycle_second_step_size=2, decay_step_size=2,
# decay_lr_rate=0.5, cycle_min_mom=[0.8, 0.85], cycle_max_mom=[0.9, 0.95],
# decay_mom_rate=0.1): (lr, betas[0]) per group after each of 9 steps
ONE_CYCLE_LISTS = [
    [(0.004, 0.8666666666666667), (0.0016666666666666663, 0.9166666666666666)],
    [(0.006999999999999999, 0.8333333333333334), (0.0028333333333333327, 0.8833333333333333)],
    [(0.009999999999999998, 0.8), (0.003999999999999999, 0.85)],
    [(0.0055, 0.8500000000000001), (0.0022499999999999994, 0.9)],
    [(0.001, 0.9), (0.0005, 0.95)],
    [(0.0008, 0.9450000000000001), (0.0004, 0.9974999999999999)],
    [(0.0006666666666666666, 0.9900000000000001), (0.0003333333333333333, 1.045)],
    [(0.0005714285714285715, 1.035), (0.00028571428571428574, 1.0924999999999998)],
    [(0.0005, 1.08), (0.00025, 1.14)],
]


def test_one_cycle_per_group_bounds_match_deepspeed() -> None:
    opt = two_groups()
    sched = OneCycle(opt, cycle_min_lr=[0.001, 0.0005], cycle_max_lr=[0.01, 0.004],
                     cycle_first_step_size=3, cycle_second_step_size=2, decay_step_size=2,
                     decay_lr_rate=0.5, cycle_min_mom=[0.8, 0.85], cycle_max_mom=[0.9, 0.95],
                     decay_mom_rate=0.1)
    assert [(g["lr"], g["betas"]) for g in opt.param_groups] == [(0.001, (0.8, 0.99)),
                                                                  (0.0005, (0.85, 0.99))]
    for row in ONE_CYCLE_LISTS:
        sched.step()
        seen = [(g["lr"], g["betas"][0]) for g in opt.param_groups]
        assert seen == [pytest.approx(pair, rel=1e-12) for pair in row]
        assert all(g["betas"][1] == 0.99 for g in opt.param_groups)


@pytest.mark.parametrize(("stairs", "expected"), [
    # DeepSpeed 0.19.8, cycle_min_lr 0.001, cycle_max_lr 0.01, first 4, second 0
    (0, [0.0032500000000000003, 0.0055000000000000005, 0.007750000000000001] + [0.001] * 7),
    # the same with min 0, max 1 and cycle_first_stair_count 2
    (2, [0.0, 0.5, 0.5] + [0.0] * 7),
])
def test_one_cycle_second_step_size_zero_matches_deepspeed(stairs: int,
                                                           expected: list[float]) -> None:
    opt = two_groups()
    low, high = (0.001, 0.01) if not stairs else (0.0, 1.0)
    sched = OneCycle(opt, low, high, cycle_first_step_size=4, cycle_second_step_size=0,
                     cycle_first_stair_count=stairs, cycle_momentum=False)
    assert [row[0] for row in lrs(sched, opt, 10)] == pytest.approx(expected, rel=1e-15)


def test_one_cycle_lists_and_zero_second_half_pass_the_config_check() -> None:
    config = resolve({"train_batch_size": 1, "scheduler": {"type": "OneCycle", "params": {
        "cycle_min_lr": [0.001, 0.0005], "cycle_max_lr": [0.01, 0.004],
        "cycle_min_mom": [0.8, 0.85], "cycle_max_mom": 0.95, "cycle_first_step_size": 3,
        "cycle_second_step_size": 0}}}, dp_size=1, dp_source="test", environ={})
    opt = two_groups()
    sched = build_scheduler(config.scheduler, opt)
    assert isinstance(sched, OneCycle)
    assert [g["betas"] for g in opt.param_groups] == [(0.8, 0.99), (0.85, 0.99)]
    with pytest.raises(DsrunConfigError, match="cycle_max_lr has 3 values for 2 param groups"):
        OneCycle(two_groups(), 0.001, [0.1, 0.2, 0.3])
    with pytest.raises(DsrunConfigError, match="cycle_second_step_size"):
        SchedulerConfig("OneCycle", {"cycle_min_lr": 0.1, "cycle_max_lr": 1.0,
                                     "cycle_second_step_size": -1})


# ------------------------------------------- torch schedulers by config name

def torch_config(kind: str, params: dict) -> Any:
    return resolve({"train_batch_size": 1, "scheduler": {"type": kind, "params": params}},
                   dp_size=1, dp_source="test", environ={}).scheduler


@pytest.mark.parametrize(("kind", "params"), [
    ("StepLR", {"step_size": 2, "gamma": 0.5}),
    ("CosineAnnealingLR", {"T_max": 5}),
    ("MultiStepLR", {"milestones": [1, 3], "gamma": 0.1}),
    ("cycliclr", {"base_lr": [0.001, 0.0005], "max_lr": 0.01, "step_size_up": 2,
                  "cycle_momentum": False}),
])
def test_torch_scheduler_from_config_is_torchs_own(kind: str, params: dict) -> None:
    """DeepSpeed's fallback: getattr(torch.optim.lr_scheduler, type)(optimizer, **params)."""
    config = torch_config(kind, params)
    opt, ref_opt = two_groups(), two_groups()
    sched = build_scheduler(config, opt)
    cls = getattr(torch.optim.lr_scheduler, config.type)
    assert type(sched) is cls and config.type.lower() == kind.lower()
    reference = cls(ref_opt, **params)
    assert lrs(sched, opt, 8) == lrs(reference, ref_opt, 8)


def test_torch_scheduler_over_a_wrapped_optimizer() -> None:
    class Wrapper:  # the ZeRO optimizers expose the torch one as .optimizer
        def __init__(self, inner: torch.optim.Optimizer) -> None:
            self.optimizer = inner
            self.param_groups = inner.param_groups

    opt = two_groups()
    sched = build_scheduler(torch_config("ExponentialLR", {"gamma": 0.5}), Wrapper(opt))
    assert sched.optimizer is opt and lrs(sched, opt, 1) == [[0.005, 0.0015]]


@pytest.mark.parametrize(("kind", "params", "fragment"), [
    ("StepLR", {"step_sise": 2}, 'unknown parameter(s) "step_sise"; did you mean "step_size"?'),
    ("StepLR", {"step_size": 2, "gama": 0.5, "nope": 1}, '"gama"; did you mean "gamma"?, "nope"'),
    ("StepLR", {"gamma": 0.5}, 'torch.optim.lr_scheduler.StepLR) needs "step_size"'),
    ("CosineAnnealingLR", {}, 'needs "T_max"'),
    ("OneCycleLR", {"max_lr": 0.1}, "torch rejected {'max_lr': 0.1}: You must define"),
])
def test_torch_scheduler_param_errors(kind: str, params: dict, fragment: str) -> None:
    with pytest.raises(DsrunConfigError) as err:
        build_scheduler(torch_config(kind, params), two_groups())
    assert fragment in str(err.value)
    if "unknown" in fragment:
        assert "valid: step_size, gamma, last_epoch" in str(err.value)


@pytest.mark.parametrize(("kind", "fragment"), [
    ("CosineAnealingLR", 'did you mean "CosineAnnealingLR"?'),
    ("WarmupCosine", 'did you mean "WarmupCosineLR"?'),
    ("LambdaLR", "lr_lambda is a Python function"),
    ("SequentialLR", "chains scheduler objects"),
])
def test_unknown_scheduler_names_cover_both_lists(kind: str, fragment: str) -> None:
    with pytest.raises(DsrunConfigError) as err:
        torch_config(kind, {})
    assert fragment in str(err.value)
    assert "valid: WarmupLR, WarmupDecayLR" in str(err.value) and "StepLR" in str(err.value)


def test_torch_scheduler_params_cannot_be_auto() -> None:
    with pytest.raises(DsrunConfigError, match='"scheduler.params.T_max" .* is "auto"'):
        torch_config("CosineAnnealingLR", {"T_max": "auto"})


# -------------------------------------------------- schedulers with a metric

def test_needs_metric_tells_plateau_apart() -> None:
    opt = two_groups()
    assert needs_metric(torch.optim.lr_scheduler.ReduceLROnPlateau(opt))
    assert not needs_metric(torch.optim.lr_scheduler.StepLR(opt, 2))
    assert not needs_metric(WarmupLR(opt)) and not needs_metric(None)
    plateau = build_scheduler(torch_config("ReduceLROnPlateau", {"patience": 0}), opt)
    assert needs_metric(plateau)


def test_torch_scheduler_list_covers_the_installed_torch() -> None:
    """The config module imports no torch, so it lists torch's scheduler
    names itself: every one the installed torch has is listed or refused."""
    from dsrun.runtime.config_optim import REFUSED_SCHEDULERS, TORCH_SCHEDULERS

    module = torch.optim.lr_scheduler
    installed = {name for name in dir(module) if isinstance(getattr(module, name), type)
                 and issubclass(getattr(module, name), module.LRScheduler)
                 and not name.startswith("_") and name != "LRScheduler"}
    listed = set(TORCH_SCHEDULERS) | {n for n in installed if n.lower() in REFUSED_SCHEDULERS}
    assert installed == listed


def test_torch_type_names_resolve_without_importing_torch() -> None:
    """The launcher checks configs without torch (test_launcher_imports.py)."""
    import subprocess
    import sys

    code = ("import sys; from dsrun.runtime.config import resolve; "
            "c = resolve({'train_batch_size': 2, 'optimizer': {'type': 'Rprop'}, "
            "'scheduler': {'type': 'cosineannealinglr', 'params': {'T_max': 3}}}, dp_size=1, "
            "dp_source='t', environ={}); print(c.scheduler.type, c.optimizer.type, "
            "'torch' in sys.modules)")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60)
    assert res.stdout.split() == ["CosineAnnealingLR", "rprop", "False"], res.stderr


def test_how_the_engine_steps_a_scheduler() -> None:
    """No arguments; lr_kwargs as given; a plateau scheduler left alone
    without them; train_batch_size for another step() that needs one
    (DeepSpeed's fallback for Megatron's step(increment)); lr_kwargs or
    arguments step() cannot take refused with its signature."""
    from dsrun.errors import DsrunError

    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    step_lr = torch.optim.lr_scheduler.StepLR(opt, 2)
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(opt)

    class Increment:
        def step(self, increment: int, token_num: object = None) -> None: ...

    class Metric:
        def step(self, metric: float) -> None: ...

    class Two:
        def step(self, a: int, b: int) -> None: ...

    assert scheduler_step_args(None, {"x": 1}, 8) is None
    assert scheduler_step_args(step_lr, None, 8) == ((), {})
    assert scheduler_step_args(plateau, None, 8) is None
    assert scheduler_step_args(Metric(), None, 8) is None
    assert scheduler_step_args(plateau, {"metrics": 2.0}, 8) == ((), {"metrics": 2.0})
    assert scheduler_step_args(Increment(), None, 8) == ((8,), {})
    assert scheduler_step_args(Increment(), {"increment": 3}, 8) == ((), {"increment": 3})
    with pytest.raises(DsrunError, match=r"StepLR\.step\(epoch\b.*= None\) does not take them"):
        scheduler_step_args(step_lr, {"foo": 1}, 8)
    with pytest.raises(DsrunError, match=r"Two\.step\(a: .int., b: .int.\) needs arguments"):
        scheduler_step_args(Two(), None, 8)
    assert takes_an_argument(Increment()) and not takes_an_argument(Metric())
    assert not takes_an_argument(step_lr) and not takes_an_argument(plateau)
    assert needs_metric(Metric()) and not needs_metric(Increment())
    # what initialize() says at once (a pipeline refuses it)
    assert needs_lr_kwargs(Two()) is not None and "Two.step(a: " in needs_lr_kwargs(Two())

    class KeywordOnly:
        def step(self, *, n: int) -> None: ...

    assert needs_lr_kwargs(KeywordOnly()) is not None
    for fine in (step_lr, plateau, Increment(), Metric(), None):
        assert needs_lr_kwargs(fine) is None
