"""A non-finite gradient outside fp16, and DeepSpeed's step attributes on
the optimizer ``initialize()`` returns, on one-rank engines in this process.

DeepSpeed 0.19.8 skips the step (``was_step_applied()`` False,
``skipped_steps`` + 1, ``get_global_grad_norm()`` inf, ``optimizer.overflow``
True) when the gradient norm is non-finite under bf16 (``check_grad_overflow``,
true by default) and under fp32 at ZeRO 1-3; plain fp32 at stage 0 steps (into
NaN), as torch does. A model handed over in bfloat16 is trained on fp32
masters at every stage."""

from __future__ import annotations

from typing import Any, Optional

import pytest
import torch

import dsrun
from dsrun.pipe import LayerSpec, PipelineModule

pytestmark = pytest.mark.dist

ADAM = {"type": "Adam", "params": {"lr": 1e-3}}


def build(stage: int, precision: Optional[dict[str, Any]] = None,
          model: Optional[torch.nn.Module] = None, optimizer: Any = ADAM,
          **extra: Any) -> tuple[Any, Any]:
    torch.manual_seed(0)
    if model is None:
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(),
                                    torch.nn.Linear(8, 2))
    config: dict[str, Any] = {"train_batch_size": 2, "optimizer": optimizer,
                              "zero_optimization": {"stage": stage}, **extra}
    if precision is not None:
        config.update(precision)
    engine, opt, _, _ = dsrun.initialize(model=model, config=config)
    return engine, opt


def masters(engine: Any) -> list[torch.Tensor]:
    return [dsrun.utils.safe_get_full_fp32_param(p).clone()
            for p in engine.module.parameters()]


def train_step(engine: Any, poison: bool = False) -> None:
    x = torch.linspace(-1, 1, 8).reshape(2, 4)
    loss = engine(x).float().pow(2).mean()
    engine.backward(loss * float("inf") if poison else loss)
    engine.step()


BF16 = {"bf16": {"enabled": True}}


@pytest.mark.parametrize("clipping", [0.0, 1.0])
@pytest.mark.parametrize("stage,precision", [(s, BF16) for s in range(4)] +
                         [(s, None) for s in (1, 2, 3)])
def test_a_non_finite_gradient_skips_the_step(solo: None, stage: int,
                                              precision: Optional[dict[str, Any]],
                                              clipping: float,
                                              caplog: pytest.LogCaptureFixture) -> None:
    engine, opt = build(stage, precision, gradient_clipping=clipping)
    assert opt.overflow is False
    train_step(engine)
    before = masters(engine)
    with caplog.at_level("WARNING", logger="dsrun.runtime"):
        train_step(engine, poison=True)
    assert not engine.was_step_applied() and engine.skipped_steps == 1
    norm = engine.get_global_grad_norm()
    assert type(norm) is float and norm == float("inf") and opt.overflow is True  # DeepSpeed's
    after = masters(engine)
    assert all(torch.equal(a, b) for a, b in zip(before, after))
    assert [r for r in caplog.records if "non-finite gradient norm" in r.getMessage()]
    train_step(engine)  # training goes on from the same weights
    assert engine.was_step_applied() and opt.overflow is False
    assert engine.global_steps == 3 and engine.skipped_steps == 1
    assert all(bool(torch.isfinite(m).all()) for m in masters(engine))
    assert not all(torch.equal(a, b) for a, b in zip(after, masters(engine)))


@pytest.mark.parametrize("stage,precision", [
    (0, None),  # plain fp32 at stage 0 steps into NaN, as torch and DeepSpeed do
    (1, {"bf16": {"enabled": True, "check_grad_overflow": False}}),  # DeepSpeed's opt-out
])
def test_where_a_non_finite_gradient_is_stepped(solo: None, stage: int,
                                                precision: Optional[dict[str, Any]]) -> None:
    engine, opt = build(stage, precision, gradient_clipping=1.0)
    train_step(engine, poison=True)
    assert engine.was_step_applied() and engine.skipped_steps == 0 and opt.overflow is False
    assert not all(bool(torch.isfinite(m).all()) for m in masters(engine))


@pytest.mark.parametrize("stage", [0, 1])
@pytest.mark.parametrize("precision", [BF16, {"fp16": {"enabled": True, "auto_cast": True,
                                                             "initial_scale_power": 8}}])
def test_a_pipeline_skips_a_non_finite_step(solo: None, stage: int,
                                            precision: dict[str, Any]) -> None:
    """bf16 and fp16 alike: skipped, the norm reported inf (not NaN)."""
    torch.manual_seed(0)
    module = PipelineModule([LayerSpec(torch.nn.Linear, 3, 4), LayerSpec(torch.nn.Linear, 4, 1)],
                            num_stages=1, loss_fn=lambda out, y: (out.float() - y).pow(2).mean())
    engine, opt, _, _ = dsrun.initialize(model=module, config={
        "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
        "optimizer": ADAM, "zero_optimization": {"stage": stage}, **precision})
    data = [(torch.randn(2, 3), torch.randn(2, 1)) for _ in range(6)]
    engine.train_batch(iter(data[:2]))
    before = [p.detach().clone() for p in module.parameters()]
    skipped = engine.skipped_steps  # fp16 may skip the first step (scale 2^16)
    data[3] = (data[3][0], torch.full((2, 1), float("nan")))  # NaN gradients
    engine.train_batch(iter(data[2:4]))
    assert not engine.was_step_applied() and engine.skipped_steps == skipped + 1
    assert opt.overflow and engine.get_global_grad_norm() == float("inf")
    assert all(torch.equal(a, b) for a, b in zip(before, module.parameters()))
    engine.train_batch(iter(data[4:]))
    assert engine.was_step_applied() and not opt.overflow


def test_stage0_fp16_optimizer_reports_scale_and_overflow(solo: None, tmp_path: Any) -> None:
    """DeepSpeed's stage-0 fp16 optimizer has ``loss_scale``/``cur_scale``
    and ``overflow``; its grad norm on a skipped step is inf even when the
    gradients hold NaN (inf * 0)."""
    fp16 = {"fp16": {"enabled": True, "initial_scale_power": 8, "hysteresis": 1,
                     "auto_cast": True}}
    engine, opt = build(0, fp16)
    assert isinstance(opt, torch.optim.Adam)  # the torch optimizer itself
    assert opt.loss_scale == opt.cur_scale == 256.0 and opt.overflow is False
    train_step(engine, poison=True)
    assert not engine.was_step_applied() and opt.overflow is True
    assert engine.get_global_grad_norm() == float("inf")
    assert opt.loss_scale == opt.cur_scale == 128.0 == engine.precision.loss_scale
    engine.save_checkpoint(str(tmp_path))
    train_step(engine)
    assert opt.overflow is False and opt.loss_scale == 128.0
    fresh, fresh_opt = build(0, fp16)
    assert fresh_opt.loss_scale == 256.0
    fresh.load_checkpoint(str(tmp_path))
    assert fresh_opt.loss_scale == fresh_opt.cur_scale == 128.0


def test_fp32_stage0_optimizer_has_no_scale_attributes(solo: None) -> None:
    _, opt = build(0)
    assert opt.overflow is False and not hasattr(opt, "loss_scale")


@pytest.mark.parametrize("stage", [0, 1])
def test_a_bf16_model_trains_on_fp32_masters(solo: None, stage: int) -> None:
    """lr 1e-5 Adam steps of ~1e-5 on weights near 0.3: below bf16's spacing
    there, they must accumulate in fp32 masters, not round away."""
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 16).to(torch.bfloat16)
    with torch.no_grad():
        model.weight.uniform_(0.25, 0.5)
    start = model.weight.detach().float().clone()
    engine, _ = build(stage, BF16, model=model,
                      optimizer={"type": "Adam", "params": {"lr": 1e-5}})
    if stage == 0:  # upcast in place: the same parameter objects, now fp32
        assert model.weight.dtype == torch.float32 and engine.module.weight is model.weight
    x = torch.randn(2, 16)
    for _ in range(5):
        loss = engine(x.to(next(engine.module.parameters()).dtype)).float().sum()
        engine.backward(loss)
        engine.step()
    moved = (dsrun.utils.safe_get_full_fp32_param(engine.module.weight) - start).abs()
    # five Adam steps of lr 1e-5 move each weight by ~5e-5 in fp32; in bf16
    # (spacing ~2e-3 there) nearly all of them would not move at all
    assert float(moved.mean()) > 3e-5


def test_stage0_bf16_upcasts_only_16bit_parameters() -> None:
    from dsrun.runtime.precision import BF16Autocast

    model = torch.nn.Sequential(torch.nn.Linear(2, 2).to(torch.bfloat16),
                                torch.nn.Linear(2, 2).to(torch.float16),
                                torch.nn.Linear(2, 2).to(torch.float64))
    kept = model[2].weight
    assert BF16Autocast.convert_module(model) == ["0.weight", "0.bias", "1.weight", "1.bias"]
    assert [p.dtype for p in model.parameters()] == [torch.float32] * 4 + [torch.float64] * 2
    assert model[2].weight is kept
