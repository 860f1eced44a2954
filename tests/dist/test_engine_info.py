"""DeepSpeed's engine accessors (dsrun.runtime.engine_info) on a one-rank
engine in this process: each answers from the resolved config or the
engine's state."""

from __future__ import annotations

import pytest
import torch

import dsrun

pytestmark = pytest.mark.dist


def build(config: dict, optimizer: object = None) -> dsrun.DsrunEngine:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    engine, _, _, _ = dsrun.initialize(model=model, config=config, optimizer=optimizer)
    return engine


def test_accessors_follow_the_config(solo: None) -> None:
    engine = build({
        "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 3,
        "optimizer": {"type": "adamw", "params": {"lr": 0.01, "betas": [0.8, 0.9]}},
        "gradient_clipping": 0.5, "steps_per_print": 7, "bf16": {"enabled": True},
        "communication_data_type": "fp32", "dataloader_drop_last": True,
        "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}})
    assert engine.get_batch_info() == (6, 2, 3)
    assert engine.get_lr() == [0.01] and engine.get_mom() == [(0.8, 0.9)]
    assert engine.bf16_enabled() and engine.bfloat16_enabled() and not engine.fp16_enabled()
    # DeepSpeed's pair: (model dtype, gradient accumulation dtype - the
    # model's unless data_types.grad_accum_dtype says otherwise)
    assert engine.get_data_types() == (torch.bfloat16, torch.bfloat16)
    assert engine.communication_data_type == torch.float32
    assert engine.zero_optimization() and engine.zero_optimization_stage() == 2
    assert engine.zero_offload_optimizer().device == "cpu" and engine.zero_cpu_offload()
    assert engine.zero_offload_param() is None
    assert engine.gradient_clipping() == 0.5 and engine.optimizer_name() == "adamw"
    assert engine.steps_per_print() == 7 and engine.dataloader_drop_last()
    assert not engine.wall_clock_breakdown() and not engine.sparse_gradients_enabled()
    assert not engine.amp_enabled()
    engine.empty_partition_cache()  # nothing held below stage 3: no effect, no error


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_offload_accessors_return_the_sections(solo: None, stage: int) -> None:
    """As DeepSpeed 0.19.8: the section object or None, and its ZeRO
    optimizers' flags (stages 1-2 ``cpu_offload``; stage 3
    ``offload_optimizer``/``offload_param``, each absent elsewhere)."""
    sections = {"offload_optimizer": {"device": "cpu", "pin_memory": True}}
    if stage == 3:
        sections["offload_param"] = {"device": "cpu"}
    base = {"train_batch_size": 2, "optimizer": {"type": "adamw", "params": {"lr": 0.01}}}
    engine = build({**base, "zero_optimization": {"stage": stage, **sections}})
    section = engine.zero_offload_optimizer()
    assert (section.device, section.pin_memory, section.ratio) == ("cpu", True, 1.0)
    assert engine.zero_use_cpu_optimizer() and engine.zero_cpu_offload()
    assert engine.zero_partial_offload() == 1.0
    plain = build({**base, "zero_optimization": {"stage": stage}})
    assert plain.zero_offload_optimizer() is None and plain.zero_offload_param() is None
    assert not plain.zero_use_cpu_optimizer() and not plain.zero_cpu_offload()
    assert plain.zero_partial_offload() == 1.0
    if stage == 3:
        assert engine.zero_offload_param().device == "cpu"
        assert engine.optimizer.offload_optimizer is True and engine.optimizer.offload_param
        assert not plain.optimizer.offload_optimizer and not plain.optimizer.offload_param
        assert not hasattr(engine.optimizer, "cpu_offload")
    else:
        assert engine.zero_offload_param() is None
        assert engine.optimizer.cpu_offload is True and plain.optimizer.cpu_offload is False
        assert not hasattr(engine.optimizer, "offload_param")
        assert not hasattr(engine.optimizer, "offload_optimizer")
    none = build({**base, "zero_optimization": {"stage": stage,
                                                "offload_optimizer": {"device": "none"}}})
    assert none.zero_offload_optimizer().device == "none" and not none.zero_use_cpu_optimizer()


def test_client_optimizer_and_defaults(solo: None) -> None:
    model_opt = []

    def sgd(params: object) -> torch.optim.Optimizer:
        model_opt.append(torch.optim.SGD(params, lr=0.1, momentum=0.7))  # type: ignore[arg-type]
        return model_opt[0]

    engine = build({"train_batch_size": 4}, optimizer=sgd)
    assert engine.optimizer_name() == "SGD" and engine.get_mom() == [0.7]
    assert engine.get_data_types() == (torch.float32, torch.float32)
    assert not engine.zero_optimization() and not engine.zero_cpu_offload()
    assert engine.get_global_grad_norm() is None and not engine.was_step_applied()
    no_opt = build({"train_batch_size": 4})
    assert no_opt.optimizer_name() is None and no_opt.get_mom() == [] and no_opt.get_lr() == []


def test_dump_state_and_memory_breakdown(solo: None, caplog: pytest.LogCaptureFixture) -> None:
    """``dump_state`` logs every resolved setting at start; ``memory_breakdown``
    a memory line after each progress line (rank 0)."""
    import json
    import logging

    with caplog.at_level(logging.INFO, logger="dsrun.runtime"):
        engine = build({"train_batch_size": 2, "steps_per_print": 2, "dump_state": True,
                        "memory_breakdown": True,
                        "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
        for _ in range(4):
            engine.backward(engine(torch.randn(2, 4)).sum())
            engine.step()
    start = next(r.getMessage() for r in caplog.records if "dump_state" in r.getMessage())
    dumped = json.loads(start.split("resolved config (dump_state):", 1)[1])
    assert dumped["train_batch_size"] == 2 and dumped["memory_breakdown"] is True
    assert dumped["optimizer"]["type"].lower() == "sgd"
    lines = [r.getMessage() for r in caplog.records if r.name == "dsrun.runtime"]
    progress = [i for i, line in enumerate(lines) if line.startswith("step=")]
    assert len(progress) == 2  # steps 2 and 4
    for i in progress:
        assert lines[i + 1].startswith("memory: host RSS ") and "(peak " in lines[i + 1]


def test_no_memory_line_by_default(solo: None, caplog: pytest.LogCaptureFixture) -> None:
    import logging

    with caplog.at_level(logging.INFO, logger="dsrun.runtime"):
        engine = build({"train_batch_size": 2, "steps_per_print": 1,
                        "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
        engine.backward(engine(torch.randn(2, 4)).sum())
        engine.step()
    assert "step=1" in caplog.text and "memory:" not in caplog.text
    assert "dump_state" not in caplog.text


class WithExtras(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Linear(4, 2)
        self.frozen = torch.nn.Linear(2, 2)
        self.frozen.requires_grad_(False)
        self.hidden_size = 4
        self._private = 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.frozen(self.body(x))

    def generate(self, x: torch.Tensor) -> torch.Tensor:
        return self(x).argmax(-1)


def test_module_attributes_pass_through(solo: None) -> None:
    """As DeepSpeed's engine: what the engine does not have, its module may."""
    torch.manual_seed(0)
    engine, _, _, _ = dsrun.initialize(model=WithExtras(), config={
        "train_batch_size": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
    x = torch.randn(2, 4)
    assert engine.hidden_size == 4 and torch.equal(engine.generate(x), engine.module.generate(x))
    assert engine.body is engine.module.body  # submodules too
    with pytest.raises(AttributeError, match="no attribute 'nothing', nor has its module "
                                             r"\(WithExtras\)"):
        engine.nothing  # noqa: B018
    assert not hasattr(engine, "_private")  # private names stay the engine's own
    assert sorted(engine.module_state_dict()) == ["body.bias", "body.weight", "frozen.bias",
                                                  "frozen.weight"]
    assert sorted(engine.module_state_dict(exclude_frozen_parameters=True)) == [
        "body.bias", "body.weight"]


def test_the_accumulation_boundary_set_by_hand_stays(solo: None) -> None:
    """DeepSpeed's pattern: False for every micro-step but the last, one step()."""
    engine = build({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4,
                    "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
    engine.set_gradient_accumulation_boundary(False)
    for _ in range(3):
        engine.backward(engine(torch.randn(2, 4)).sum())
        engine.step()  # not a boundary: the value set stays
    assert engine.global_steps == 0 and not engine.is_gradient_accumulation_boundary()
    engine.set_gradient_accumulation_boundary(True)
    engine.backward(engine(torch.randn(2, 4)).sum())
    engine.step()
    engine.backward(engine(torch.randn(2, 4)).sum())
    engine.step()
    assert engine.global_steps == 2 and engine.is_gradient_accumulation_boundary()


@pytest.mark.parametrize("stage, bf16", [(0, True), (1, False), (2, False), (3, False)])
def test_the_grad_norm_is_reported_where_deepspeed_reports_it(solo: None, stage: int,
                                                              bf16: bool) -> None:
    """ZeRO stages and bf16 report the step's norm without clipping too (a
    clip that never acts gives the same norm); fp32 at stage 0 does not."""
    norms = []
    x = torch.randn(2, 4, generator=torch.Generator().manual_seed(1))
    for clip in (0.0, 1e9):
        engine = build({"train_batch_size": 2, "gradient_clipping": clip,
                        "zero_optimization": {"stage": stage}, "bf16": {"enabled": bf16},
                        "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
        engine.backward(engine(x).float().pow(2).sum())
        engine.step()
        norms.append(engine.get_global_grad_norm())
    assert norms[0] is not None and norms[0] > 0
    if stage == 0:  # DeepSpeed's types: a float at stage 0, a 0-d tensor at ZeRO stages
        assert all(type(n) is float for n in norms)
    else:
        assert all(isinstance(n, torch.Tensor) and n.shape == () and n.dtype == torch.float32
                   for n in norms)
    assert norms[0].item() == pytest.approx(norms[1].item(), rel=1e-6) if stage else \
        norms[0] == pytest.approx(norms[1], rel=1e-6)


def _train(engine: dsrun.DsrunEngine, steps: int) -> None:
    for _ in range(steps):
        for _ in range(engine.gradient_accumulation_steps()):
            loss = engine(torch.randn(2, 4)).float().pow(2).mean()
            engine.backward(loss)
            engine.step()


def test_memory_breakdown_is_the_config_flag(solo: None) -> None:
    assert not build({"train_batch_size": 2}).memory_breakdown()
    assert build({"train_batch_size": 2, "memory_breakdown": True}).memory_breakdown()


def test_wall_clock_timers_empty_without_the_breakdown(solo: None) -> None:
    engine = build({"train_batch_size": 2, "optimizer": {"type": "sgd", "params": {"lr": 0.1}}})
    _train(engine, 2)
    assert engine.get_wall_clock_timers() == {}  # DeepSpeed's: never filled then


def test_wall_clock_timers_hold_the_last_step(solo: None) -> None:
    engine = build({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
                    "wall_clock_breakdown": True, "steps_per_print": 100,
                    "optimizer": {"type": "sgd", "params": {"lr": 0.1}}})
    assert engine.get_wall_clock_timers() == {}  # before the first step, as DeepSpeed
    _train(engine, 2)
    timers = engine.get_wall_clock_timers()
    assert set(timers) == {"fwd", "bwd", "bwd_inner", "bwd_allreduce", "step"}
    assert all(v >= 0 for v in timers.values()) and timers["fwd"] > 0
    assert timers["bwd"] == pytest.approx(timers["bwd_inner"] + timers["bwd_allreduce"])


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_zero_optimizer_scale_is_one_without_fp16(solo: None, stage: int,
                                                   precision: str) -> None:
    config: dict = {"train_batch_size": 2, "zero_optimization": {"stage": stage},
                    "optimizer": {"type": "adam", "params": {"lr": 0.01}}}
    if precision == "bf16":
        config["bf16"] = {"enabled": True}
    engine = build(config)
    _train(engine, 1)
    # DeepSpeed's ZeRO optimizers: 1.0 without loss scaling, under both names
    assert engine.optimizer.cur_scale == 1.0 and engine.optimizer.loss_scale == 1.0


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_optimizer_scale_is_the_fp16_scale(solo: None, stage: int) -> None:
    engine = build({"train_batch_size": 2, "zero_optimization": {"stage": stage},
                    "fp16": {"enabled": True, "initial_scale_power": 8},
                    "optimizer": {"type": "adam", "params": {"lr": 0.01}}})
    assert engine.optimizer.cur_scale == 256.0  # before any step too
    engine.precision.scaler.scale = 2.0**5  # the scaler the steps update
    assert engine.optimizer.cur_scale == engine.optimizer.loss_scale == 32.0
