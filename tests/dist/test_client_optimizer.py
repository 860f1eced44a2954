"""The script's own optimizer and LR scheduler after initialize(), at ZeRO
stages 0-3, as DeepSpeed: the client's optimizer object is the one that
steps (its param groups over the partitions), so a hand-written schedule
or weight-decay change on it takes effect; a ReduceLROnPlateau is stepped
by the script with its metric, never by engine.step(); config schedulers
and optimizers that name torch classes; get_mom() for optimizers without
momentum.

The 2-rank cases run in one dsrun job (workers/client_optim_cases.py); a
stage's numbers must match stage 0's (the same arithmetic: <= 1e-6, the
ZeRO parity tolerance, see test_zero_stage12.py). The rest run on a
one-rank group in this process.
"""

from __future__ import annotations

import json
import os
import subprocess
from typing import Any

import pytest
import torch

import dsrun
from dsrun.errors import DsrunConfigError, DsrunError
from tests.conftest import ROOT, dsrun_argv

pytestmark = pytest.mark.dist

WORKER = ROOT / "tests" / "dist" / "workers" / "client_optim_cases.py"
LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                 "MASTER_PORT", "DSRUN_CONFIG", "DSRUN_JOB_ID")
TOLERANCE = 1e-6
ZERO = (1, 2, 3)


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out = tmp_path_factory.mktemp("client_optim")
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS}
    res = subprocess.run(dsrun_argv("--cpu", "--num_gpus", "2", str(WORKER), "--out", str(out)),
                         capture_output=True, text=True, timeout=600, env=env, cwd=str(ROOT))
    files = sorted(out.glob("rank*.json"))
    assert res.returncode == 0 and files, f"job failed ({res.returncode}):\n{res.stderr[-4000:]}"
    results = [json.loads(f.read_text()) for f in files]
    assert [r["world_size"] for r in results] == [2, 2]
    return results


def facts(results: list[dict[str, Any]], name: str) -> list[dict[str, Any]]:
    found = [r[name] for r in results]
    for rank, fact in enumerate(found):
        assert fact["ok"], f"{name}, rank {rank}:\n{fact['error']}"
    return found


def max_diff(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b)
    return max(abs(x - y) for x, y in zip(a, b))


@pytest.mark.parametrize("stage", ZERO)
def test_hand_written_schedule_on_the_client_optimizer(two_ranks: list[dict[str, Any]],
                                                       stage: int) -> None:
    """lr 0 for the weights at step 2, the biases' weight_decay 0.1 -> 0.5,
    then lr 0.02 for all at step 4: the same run as at stage 0."""
    for ref, got in zip(facts(two_ranks, "hand_s0"), facts(two_ranks, f"hand_s{stage}")):
        assert got["client_steps"] and got["client_has_state"]
        assert got["returned_groups_are_clients"] == [True, True]
        assert got["lrs"] == ref["lrs"]
        assert got["lrs"][2] == [0.0, 0.003] and got["lrs"][5] == [0.02, 0.02]
        assert got["weights_moved_at_lr0"] == 0.0 == ref["weights_moved_at_lr0"]
        assert max_diff(got["losses"], ref["losses"]) <= TOLERANCE
        assert max_diff(got["params"], ref["params"]) <= TOLERANCE
        # after save + load, the client's object still drives the step
        assert got["after_load_weights_moved_at_lr0"] == 0.0
        assert got["after_load_lr"] == [0.0, 0.02]


@pytest.mark.parametrize("stage", (0, *ZERO))
def test_plateau_scheduler_is_stepped_by_the_script(two_ranks: list[dict[str, Any]],
                                                    stage: int) -> None:
    """engine.step() leaves ReduceLROnPlateau alone (DeepSpeed passes it
    train_batch_size as a metric, halving the lr at every step here);
    engine.lr_scheduler.step(metric) and lr_kwargs reach the lr that steps."""
    for ref, got in zip(facts(two_ranks, "plateau_s0"), facts(two_ranks, f"plateau_s{stage}")):
        assert got["returned_is_client"]
        assert got["trained_lr"] == [0.01]
        assert got["after_metric_lr"] == [0.005]
        assert got["after_lr_kwargs_lr"] == [0.0025]
        assert max_diff(got["losses"], ref["losses"]) <= TOLERANCE
        assert max_diff(got["params"], ref["params"]) <= TOLERANCE


@pytest.mark.parametrize("stage", (0, *ZERO))
def test_client_torch_scheduler_gives_no_torch_warning(two_ranks: list[dict[str, Any]],
                                                       stage: int) -> None:
    for got in facts(two_ranks, f"warnings_s{stage}"):
        assert got["scheduler_warnings"] == []
        expected = torch.optim.lr_scheduler.CosineAnnealingLR
        assert got["lrs"] == got["last_lr"] and got["lrs"][0] == pytest.approx(
            0.01 * (1 + torch.cos(torch.tensor(3 / 4 * torch.pi)).item()) / 2), expected


# ------------------------------------------------------------ one rank

def engine_for(config: dict[str, Any], **kwargs: Any) -> Any:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    engine, _, _, _ = dsrun.initialize(model=model, config={"train_batch_size": 2, **config},
                                       **kwargs)
    return engine


def train(engine: Any, steps: int) -> None:
    for step in range(steps):
        gen = torch.Generator().manual_seed(step)
        engine.backward(engine(torch.randn(2, 4, generator=gen)).pow(2).mean())
        engine.step()


@pytest.mark.parametrize("stage", [0, 1])
def test_get_mom_is_zero_without_momentum(solo: None, stage: int) -> None:
    """DeepSpeed's _get_optimizer_param: 0.0 for a group without the key."""
    engine = engine_for({"optimizer": {"type": "Adagrad", "params": {"lr": 0.1}},
                         "zero_optimization": {"stage": stage}})
    assert engine.get_mom() == [0.0]
    assert f"{engine.get_mom()[0]:.3f}" == "0.000"


def test_config_torch_scheduler_steps_once_per_optimizer_step(solo: None) -> None:
    engine = engine_for({"train_batch_size": 4, "gradient_accumulation_steps": 2,
                         "optimizer": {"type": "AdamW", "params": {"lr": 0.1}},
                         "scheduler": {"type": "StepLR",
                                       "params": {"step_size": 2, "gamma": 0.5}},
                         "zero_optimization": {"stage": 2}})
    assert type(engine.lr_scheduler) is torch.optim.lr_scheduler.StepLR
    seen = []
    for _ in range(4):
        train(engine, 2)  # one optimizer step (2 micro-steps)
        seen.append(engine.get_lr()[0])
    assert seen == pytest.approx([0.1, 0.05, 0.05, 0.025])


def test_config_plateau_scheduler_is_left_to_the_script(solo: None) -> None:
    engine = engine_for({"optimizer": {"type": "SGD", "params": {"lr": 0.1}},
                         "scheduler": {"type": "ReduceLROnPlateau",
                                       "params": {"patience": 0, "factor": 0.1}}})
    train(engine, 3)
    assert engine.get_lr() == [0.1]
    engine.lr_scheduler.step(1.0)
    engine.lr_scheduler.step(1.0)
    assert engine.get_lr() == pytest.approx([0.01])


class IncrementScheduler:
    """Megatron-DeepSpeed's OptimizerParamScheduler shape: ``step(increment)``
    counts samples, the lr warms up over 8 of them."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer, self.num_steps = optimizer, 0

    def step(self, increment: int, token_num: Any = None) -> None:
        self.num_steps += increment
        for group in self.optimizer.param_groups:
            group["lr"] = 0.1 * min(1.0, self.num_steps / 8)


@pytest.mark.parametrize("stage", [0, 2])
def test_a_step_increment_scheduler_gets_train_batch_size(solo: None, stage: int) -> None:
    """DeepSpeed's fallback for Megatron: a ``step()`` that needs an argument
    other than a metric is passed ``train_batch_size``; Megatron's own
    ``lr_kwargs={"increment": n}`` reaches it as given."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    sched = IncrementScheduler(opt)
    engine, _, _, returned = dsrun.initialize(
        model=model, optimizer=opt, lr_scheduler=sched,
        config={"train_batch_size": 4, "zero_optimization": {"stage": stage}})
    assert returned is sched
    seen = []
    for _ in range(3):
        train(engine, 1)
        seen.append(engine.get_lr()[0])
    assert sched.num_steps == 12 and seen == pytest.approx([0.05, 0.1, 0.1])
    engine.backward(engine(torch.ones(2, 4)).pow(2).mean())
    engine.step(lr_kwargs={"increment": 1})
    assert sched.num_steps == 13


def test_lr_kwargs_the_scheduler_refuses_change_nothing(solo: None) -> None:
    """Refused before the optimizer step (DeepSpeed raises after it, or
    falls back to step(train_batch_size)): the parameters, gradients and
    counters are as they were, and the step can be retried."""
    engine = engine_for({"optimizer": {"type": "SGD", "params": {"lr": 0.1}},
                         "scheduler": {"type": "StepLR", "params": {"step_size": 1}}})
    engine.backward(engine(torch.ones(2, 4)).pow(2).mean())
    before = [p.detach().clone() for p in engine.module.parameters()]
    with pytest.raises(DsrunError, match=r"lr_kwargs=\{'foo': 1\}.*StepLR\.step.*nothing was"):
        engine.step(lr_kwargs={"foo": 1})
    assert all(torch.equal(a, p) for a, p in zip(before, engine.module.parameters()))
    assert engine.global_steps == 0 and engine.micro_steps == 0
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in engine.module.parameters())
    engine.step()
    assert engine.global_steps == 1


def test_a_pipeline_steps_an_increment_scheduler(solo: None) -> None:
    """Megatron-DeepSpeed's pipeline path calls only train_batch(): its
    schedule advances by train_batch_size per batch, as in DeepSpeed."""
    from dsrun.pipe import LayerSpec, PipelineModule

    module = PipelineModule([LayerSpec(torch.nn.Linear, 3, 4), LayerSpec(torch.nn.Linear, 4, 1)],
                            num_stages=1, loss_fn=torch.nn.MSELoss())
    opt = torch.optim.SGD(module.parameters(), lr=0.0)
    engine, _, _, _ = dsrun.initialize(model=module, optimizer=opt,
                                       lr_scheduler=IncrementScheduler(opt), config={
        "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2})
    data = iter([(torch.randn(2, 3), torch.randn(2, 1)) for _ in range(4)])
    engine.train_batch(data)
    assert engine.get_lr() == pytest.approx([0.05])
    engine.train_batch(data)
    assert engine.get_lr() == pytest.approx([0.1])


def test_a_scheduler_the_engine_cannot_step_is_named_at_initialize(
        solo: None, caplog: pytest.LogCaptureFixture) -> None:
    """step(a, b) needs lr_kwargs at every engine.step(): a warning at
    initialize(); a pipeline, whose train_batch() passes none, refuses it."""
    from dsrun.pipe import LayerSpec, PipelineModule

    class TwoArgs:
        def __init__(self, optimizer: torch.optim.Optimizer) -> None:
            self.optimizer = optimizer

        def step(self, a: int, b: int) -> None:
            pass

    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with caplog.at_level("WARNING"):
        dsrun.initialize(model=model, optimizer=opt, lr_scheduler=TwoArgs(opt),
                         config={"train_batch_size": 2})
    assert "every engine.step() must pass lr_kwargs: TwoArgs.step(a: " in caplog.text
    module = PipelineModule([LayerSpec(torch.nn.Linear, 3, 1)], num_stages=1,
                            loss_fn=torch.nn.MSELoss())
    opt = torch.optim.SGD(module.parameters(), lr=0.1)
    with pytest.raises(DsrunConfigError, match="train_batch.. steps it without arguments, "
                                               "but TwoArgs.step"):
        dsrun.initialize(model=module, optimizer=opt, lr_scheduler=TwoArgs(opt),
                         config={"train_micro_batch_size_per_gpu": 2})


def test_config_torch_optimizers(solo: None) -> None:
    engine = engine_for({"optimizer": {"type": "Rprop", "params": {"lr": 0.01}},
                         "zero_optimization": {"stage": 2}})
    assert type(engine.optimizer.optimizer) is torch.optim.Rprop
    train(engine, 2)
    if hasattr(torch.optim, "Adafactor"):
        engine = engine_for({"optimizer": {"type": "Adafactor"}})
        assert type(engine.optimizer) is torch.optim.Adafactor
        train(engine, 2)
        with pytest.raises(DsrunConfigError, match="Adafactor needs whole-tensor"):
            engine_for({"optimizer": {"type": "Adafactor"}, "zero_optimization": {"stage": 1}})


def test_client_optimizer_object_steps_at_world_size_1(solo: None) -> None:
    """The world-size-1 path of the same rule (stage 3 without hooks)."""
    for stage in ZERO:
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 1)
        opt = torch.optim.AdamW(model.parameters(), lr=0.1)
        engine, _, _, _ = dsrun.initialize(model=model, optimizer=opt, config={
            "train_batch_size": 2, "zero_optimization": {"stage": stage}})
        for group in opt.param_groups:
            group["lr"] = 0.0
        params = list(engine.module.parameters())
        with dsrun.zero.GatheredParameters(params, enabled=stage == 3):
            before = [p.detach().clone() for p in params]
        train(engine, 2)
        with dsrun.zero.GatheredParameters(params, enabled=stage == 3):
            assert all(torch.equal(a, p) for a, p in zip(before, params)), stage
        assert engine.get_lr() == [0.0] and engine.optimizer.optimizer is opt


def test_an_optimizer_stepping_for_one_zero_engine_is_refused_by_another(solo: None) -> None:
    """Its param groups hold the first engine's partitions: a second engine
    would step those, never its own model (silently)."""
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    config = {"train_batch_size": 2, "zero_optimization": {"stage": 2}}
    dsrun.initialize(model=model, optimizer=opt, config=config)
    with pytest.raises(DsrunConfigError, match="already steps for a ZeRO engine"):
        dsrun.initialize(model=torch.nn.Linear(4, 1), optimizer=opt, config=config)


@pytest.mark.parametrize("stage", [0, 1])
def test_a_pipeline_engine_steps_the_client_optimizer_object(solo: None, stage: int) -> None:
    """The same rule through ``train_batch``: an lr set by hand on the
    script's optimizer between batches is the one the step uses."""
    from dsrun.pipe import LayerSpec, PipelineModule

    torch.manual_seed(0)
    module = PipelineModule([LayerSpec(torch.nn.Linear, 3, 4), LayerSpec(torch.nn.Linear, 4, 1)],
                            num_stages=1, loss_fn=torch.nn.MSELoss())
    opt = torch.optim.SGD(module.parameters(), lr=0.1)
    engine, returned, _, _ = dsrun.initialize(model=module, optimizer=opt, config={
        "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
        "zero_optimization": {"stage": stage}})
    data = iter([(torch.randn(2, 3), torch.randn(2, 1)) for _ in range(6)])

    def moved() -> bool:
        before = [p.detach().clone() for p in module.parameters()]
        engine.train_batch(data)
        return not all(torch.equal(a, p) for a, p in zip(before, module.parameters()))

    assert moved()
    opt.param_groups[0]["lr"] = 0.0
    assert not moved() and engine.get_lr() == [0.0]
    opt.param_groups[0]["lr"] = 0.1
    assert moved()
    assert (returned is opt) if stage == 0 else (returned.optimizer is opt)


@pytest.mark.parametrize("stage", [0, 3])
def test_a_scheduler_section_without_an_optimizer_builds_no_scheduler(
        solo: None, stage: int, caplog: pytest.LogCaptureFixture) -> None:
    """As DeepSpeed: an engine with no optimizer (Hugging Face's evaluation-only
    ZeRO-3 engines keep the config's scheduler section, its step counts filled
    with 0) builds no LR scheduler and evaluates; a section that does not check
    out is raised once an optimizer comes."""
    zero = {"stage": stage}
    for params in ({"warmup_num_steps": 2},
                   {"warmup_num_steps": 0, "total_num_steps": 0}):
        kind = "WarmupLR" if len(params) == 1 else "WarmupDecayLR"
        config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": zero,
                  "scheduler": {"type": kind, "params": params}}
        engine, optimizer, _, scheduler = dsrun.initialize(model=torch.nn.Linear(4, 4),
                                                           config=config)
        assert scheduler is None and engine.lr_scheduler is None
        if params["warmup_num_steps"] == 0:  # named, not raised: nothing would use it
            assert "would be refused" in caplog.text and "warmup_num_steps" in caplog.text
        with torch.no_grad():
            assert engine(torch.ones(1, 4)).shape == (1, 4)
        engine.destroy()
    model = torch.nn.Linear(4, 4)
    with pytest.raises(DsrunConfigError, match=r"scheduler.params.warmup_num_steps"):
        dsrun.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                         config={"train_micro_batch_size_per_gpu": 1, "zero_optimization": zero,
                                 "scheduler": {"type": "WarmupLR",
                                               "params": {"warmup_num_steps": 0}}})
    with pytest.raises(DsrunConfigError, match=r"scheduler.params.warmup_num_steps"):
        dsrun.initialize(model=torch.nn.Linear(4, 4), config={
            "train_micro_batch_size_per_gpu": 1, "zero_optimization": zero,
            "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
            "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 0}}})
