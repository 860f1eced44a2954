"""DeepSpeed's optimizers from dsrun.ops.adam as ``initialize(optimizer=...)``
at world size 1, every ZeRO stage: the engine trains as plain torch does.

Stage 0 steps the client optimizer itself: bitwise torch's AdamW with the
same (fused) kernel. Stages 1-3 rebuild it over flat fp32 masters (same
class, same groups); torch's fused CPU kernel rounds an element by its
position in the tensor, so there the bound is 1e-6 (as in
test_zero_stage12.py and test_zero_stage3.py).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import dsrun
from dsrun.ops.adam import DeepSpeedCPUAdam, FusedAdam
from tests.dist.world1 import small_model, two_groups

pytestmark = pytest.mark.dist

TOLERANCE = 1e-6
FUSED = True if "cpu" in dsrun.ops.adam.fused_devices() else None  # torch >= 2.4


def reference(decoupled: bool) -> torch.nn.Module:
    model = small_model()
    torch_cls = torch.optim.AdamW if decoupled else torch.optim.Adam
    opt = torch_cls(two_groups(model), lr=0.01, weight_decay=0.05, fused=FUSED)
    g = torch.Generator().manual_seed(1)
    for _ in range(6):
        model(torch.randn(4, 7, generator=g)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    return model


@pytest.mark.parametrize(("cls", "decoupled", "stage", "offload"), [
    (FusedAdam, True, 0, False),
    (FusedAdam, True, 1, False),
    (FusedAdam, False, 2, False),
    (DeepSpeedCPUAdam, True, 2, True),
    (FusedAdam, True, 3, False),
])
def test_engine_trains_as_torch(solo: None, cls: type, decoupled: bool, stage: int,
                                offload: bool) -> None:
    switch = "adam_w_mode" if cls is FusedAdam else "adamw_mode"
    model = small_model()
    opt = cls(two_groups(model), lr=0.01, weight_decay=0.05, **{switch: decoupled})
    zero: dict[str, Any] = {"stage": stage}
    if offload:
        zero["offload_optimizer"] = {"device": "cpu"}
    config = {"train_micro_batch_size_per_gpu": 4, "steps_per_print": 1000,
              "zero_optimization": zero}
    engine, engine_opt, _, _ = dsrun.initialize(model=model, optimizer=opt, config=config)
    inner = engine.optimizer.optimizer if stage else engine.optimizer
    assert type(inner) is cls and inner.adam_w_mode is decoupled
    assert [g["lr"] for g in inner.param_groups] == [0.01, 0.03]
    # torch's fastest kernel for what it steps (ZeRO: the fp32 masters)
    assert all(g["fused"] is FUSED for g in inner.param_groups)
    if offload:
        assert engine.optimizer.settings.offload_optimizer
    if stage and FUSED:  # labelled as what runs, and stepped whole (no host pieces)
        assert engine.optimizer.inner_impl == "fused"
        if not offload:
            assert all(len(p["params"]) == 1 for p in inner.param_groups)
    g = torch.Generator().manual_seed(1)
    for _ in range(6):
        engine.backward(engine(torch.randn(4, 7, generator=g)).square().mean())
        engine.step()
    assert inner.state  # it stepped
    expected = reference(decoupled)
    pairs = list(zip(expected.parameters(), engine.module.parameters()))
    if stage == 0:
        assert all(torch.equal(a, b) for a, b in pairs)
    else:
        assert max((a - b).abs().max().item() for a, b in pairs) <= TOLERANCE
