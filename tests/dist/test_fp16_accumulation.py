"""fp16 overflow under gradient accumulation is the same decision at every
ZeRO stage, world size and offload setting.

Two micro-steps whose float16 gradients are finite (50000 per element) but
whose sum (100000) is not: DeepSpeed 0.19.8 skips that step at stages 1-3,
with and without offload, and so do dsrun's float16 flat gradients (stages
0-1). Stages 2-3 at world size 2, or with offload, sum the reduced
micro-steps in fp32 accumulators, where the sum stays finite: the overflow
check tests it against float16's range. World size 1 runs in this process
(``solo``), world size 2 in one dsrun job (workers/fp16_accumulation.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import dsrun
from tests.conftest import ROOT, rank_results
from tests.dist.workers.fp16_accumulation import cases, config, probe

pytestmark = pytest.mark.dist

WORKER = ROOT / "tests" / "dist" / "workers" / "fp16_accumulation.py"
SKIPPED = {"skipped": 1, "scale": 2.0, "norm": float("inf")}  # scale 4 halved


@pytest.mark.parametrize("name", sorted(cases()))
def test_an_accumulated_sum_beyond_float16_skips_at_world_1(solo: None, name: str) -> None:
    stage, offload = cases()[name]
    assert probe(stage, offload) == SKIPPED


def test_a_sum_within_float16_steps(solo: None) -> None:
    # 2 x 30000 = 60000 < 65504: the same path, no overflow
    result = probe(3, True, factor=15000.0)
    assert result["skipped"] == 0 and result["scale"] == 4.0
    assert result["norm"] == pytest.approx(15000.0 * 4, rel=1e-3)  # 16 elements of 15000


def test_an_accumulated_sum_beyond_float16_skips_at_world_2(tmp_path: Path) -> None:
    ranks = rank_results(WORKER, tmp_path, 2, timeout=240)
    for rank, seen in enumerate(ranks):
        wrong = {name: got for name, got in seen.items() if got != SKIPPED}
        assert not wrong, f"rank {rank}: not skipped as an overflow: {wrong}"


@pytest.mark.parametrize("stage,offload", [(0, False), (1, False), (2, True), (3, True)])
def test_a_growing_scale_unscales_by_the_one_backward_used(solo: None, stage: int,
                                                           offload: bool) -> None:
    """Scale window 1: the scale doubles after every clean step; each SGD
    update must still be lr x the true gradient (DeepSpeed's ZeRO divides by
    the grown scale on those steps: a half-size update)."""
    cfg: dict[str, Any] = {**config(stage, offload), "gradient_accumulation_steps": 1}
    cfg["optimizer"] = {"type": "SGD", "params": {"lr": 0.125}}
    cfg["fp16"] = {"enabled": True, "initial_scale_power": 4, "loss_scale_window": 1}
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2, bias=False)
    engine, *_ = dsrun.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    scales = []
    for _ in range(3):
        before = dsrun.utils.safe_get_full_fp32_param(engine.module.weight).clone()
        scales.append(engine.optimizer.cur_scale)
        engine.backward(engine(torch.ones(1, 4, dtype=torch.float16)).float().sum())
        engine.step()  # the gradient is 1.0 per element
        after = dsrun.utils.safe_get_full_fp32_param(engine.module.weight)
        assert torch.equal(after, before - 0.125), (stage, scales)
    scales.append(engine.optimizer.cur_scale)
    assert scales[-1] > scales[0] and engine.skipped_steps == 0
    engine.destroy()
