"""``optimizer.step()`` on the ZeRO optimizer ``initialize()`` returned, as
Lightning Fabric calls it instead of ``engine.step()``: the same step (fp16
unscale, overflow skip, clipping) as DeepSpeed's ZeRO optimizers take in
their own ``step()``; one-rank engines in this process."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import dsrun

pytestmark = pytest.mark.dist


def build(stage: int, precision: str) -> tuple[Any, Any]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    config: dict[str, Any] = {
        "train_batch_size": 2, "gradient_clipping": 0.01,
        "optimizer": {"type": "SGD", "params": {"lr": 0.5}},
        "zero_optimization": {"stage": stage}}
    if precision == "fp16":
        config["fp16"] = {"enabled": True, "initial_scale_power": 8, "hysteresis": 1}
    engine, optimizer, _, _ = dsrun.initialize(model=model, config=config)
    return engine, optimizer


def params(engine: Any) -> list[torch.Tensor]:
    with dsrun.zero.GatheredParameters(list(engine.module.parameters()),
                                       enabled=engine.zero_stage == 3):
        return [p.detach().float().clone() for p in engine.module.parameters()]


def batch(engine: Any) -> torch.Tensor:
    dtype = torch.float16 if engine.fp16_enabled() else torch.float32
    return torch.randn(2, 4, generator=torch.Generator().manual_seed(1)).to(dtype)


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_optimizer_step_is_the_engines_step(solo: None, stage: int, precision: str) -> None:
    results = []
    for direct in (False, True):
        engine, optimizer = build(stage, precision)
        for _ in range(2):
            engine.backward(engine(batch(engine)).float().pow(2).sum() * 100)
            if direct:
                optimizer.step()
                optimizer.zero_grad()
            else:
                engine.step()
        results.append((params(engine), float(engine.get_global_grad_norm())))
        assert engine.was_step_applied()
        if direct:  # as DeepSpeed: the engine's counters do not move
            assert engine.global_steps == 0
        engine.destroy()
    (ref, ref_norm), (got, got_norm) = results
    assert got_norm == pytest.approx(ref_norm) and ref_norm > 0.01  # clipping acted
    assert all(torch.equal(a, b) for a, b in zip(ref, got))


@pytest.mark.parametrize("stage", [1, 3])
def test_an_fp16_overflow_is_skipped_by_optimizer_step(solo: None, stage: int,
                                                       caplog: pytest.LogCaptureFixture) -> None:
    engine, optimizer = build(stage, "fp16")
    before = params(engine)
    scale = optimizer.cur_scale
    engine.backward(engine(batch(engine)).float().sum() * 1e30)  # inf in float16
    with caplog.at_level("INFO", logger="dsrun.runtime"):
        optimizer.step()
    assert "overflow" in caplog.text.lower()  # said as engine.step() says it
    assert optimizer.overflow is True and not engine.was_step_applied()
    assert optimizer.cur_scale < scale  # the scaler saw the overflow
    assert all(torch.equal(a, b) for a, b in zip(before, params(engine)))
    engine.destroy()
