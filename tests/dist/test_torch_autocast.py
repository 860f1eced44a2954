"""The ``torch_autocast`` config section in a one-rank engine (the ``solo``
group): fp16 against torch's own ``autocast`` + ``GradScaler`` loop at ZeRO
stages 0-3 (an fp16 overflow included: the step is skipped and the scale
halves), the scaler across a checkpoint, bf16 against a plain autocast loop,
and a safe-module list that does not import."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import dsrun
from dsrun.errors import DsrunConfigError

pytestmark = pytest.mark.dist
OVERFLOW_AT = 2  # this batch overflows float16 in the forward


def net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.GELU(), torch.nn.Linear(16, 3))


def batches(n: int = 6) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    out = [torch.randn(4, 6, generator=g) for _ in range(n)]
    out[OVERFLOW_AT] = out[OVERFLOW_AT] * 1e5
    return out


def engine_for(stage: int, dtype: str, **extra: Any) -> Any:
    config = {"train_micro_batch_size_per_gpu": 4, "steps_per_print": 1000,
              "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.0}},
              "zero_optimization": {"stage": stage},
              "torch_autocast": {"enabled": True, "dtype": dtype}, **extra}
    engine, *_ = dsrun.initialize(model=net(), config=config)
    return engine


def engine_step(engine: Any, x: torch.Tensor) -> float:
    loss = engine(x).float().square().mean()
    engine.backward(loss)
    engine.step()
    return float(loss.detach())


@pytest.mark.parametrize("stage", (0, 1, 2, 3))
def test_fp16_matches_torch_autocast_and_grad_scaler(solo: None, stage: int) -> None:
    engine = engine_for(stage, "fp16")
    assert not engine.fp16_enabled()  # as DeepSpeed: fp16 is the other section
    model = net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.0)
    scaler = torch.amp.GradScaler("cpu")
    for i, x in enumerate(batches()):
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(x).float().square().mean()
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
        ours = engine_step(engine, x)
        if i != OVERFLOW_AT:
            assert ours == float(loss.detach()), (i, ours, float(loss.detach()))
        else:
            assert not torch.isfinite(loss)
            if stage > 0:  # the skipped step's norm: inf, as DeepSpeed's ZeRO reports it
                assert engine.get_global_grad_norm() == float("inf")
        assert engine.precision.loss_scale == scaler.get_scale(), i
    assert engine.skipped_steps == 1 and engine.global_steps == 6
    assert engine.precision.loss_scale == 2.0**15
    for ref, got in zip(model.parameters(), engine.module.parameters()):
        assert got.dtype == torch.float32
        if stage == 0:
            assert torch.equal(ref, got)
        elif got.shape == ref.shape:  # stage 3 parameters are shards outside forward
            torch.testing.assert_close(got, ref, rtol=0, atol=1e-6)


def test_fp16_scaler_state_survives_a_checkpoint(solo: None, tmp_path: Path) -> None:
    engine = engine_for(1, "float16")
    data = batches()
    for x in data[:4]:
        engine_step(engine, x)
    engine.save_checkpoint(tmp_path)
    saved = engine.precision.scaler.state_dict()
    after = [engine_step(engine, x) for x in data[4:]]
    resumed = engine_for(1, "float16")
    resumed.load_checkpoint(tmp_path)
    assert resumed.precision.loss_scale == 2.0**15 and resumed.skipped_steps == 1
    assert resumed.precision.scaler.state_dict() == saved
    assert [engine_step(resumed, x) for x in data[4:]] == after


def test_bf16_runs_the_forward_in_bfloat16_over_fp32_weights(solo: None) -> None:
    engine = engine_for(0, "bf16")
    seen: list[torch.dtype] = []
    engine.module[0].register_forward_hook(lambda _m, _i, out: seen.append(out.dtype))
    model = net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.0)
    for x in batches()[:OVERFLOW_AT]:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(x).float().square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        assert engine_step(engine, x) == float(loss.detach())
    assert seen == [torch.bfloat16] * OVERFLOW_AT
    assert all(p.dtype == torch.float32 for p in engine.module.parameters())
    assert engine.precision.loss_scale == 1.0 and not engine.bfloat16_enabled()


def test_safe_modules_that_do_not_import_are_named(solo: None) -> None:
    with pytest.raises(DsrunConfigError, match="cannot import 'torch.nn.Linearr'"):
        engine_for(0, "bf16", torch_autocast={"enabled": True,
                                              "lower_precision_safe_modules": ["torch.nn.Linearr"]})
    with pytest.raises(DsrunConfigError, match="'torch.nn.init' is not a class"):
        engine_for(0, "bf16", torch_autocast={"enabled": True,
                                              "lower_precision_safe_modules": ["torch.nn.init"]})
