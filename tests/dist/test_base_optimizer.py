"""``deepspeed.runtime.base_optimizer``: dsrun's ZeRO optimizers are
DeepSpeed's ``ZeROOptimizer``/``DeepSpeedOptimizer`` for ``isinstance``, as
Lightning Fabric's ``load()`` checks before it loads an optimizer's state;
one-rank engines in this process."""

from __future__ import annotations

import pytest
import torch

import dsrun

pytestmark = pytest.mark.dist


@pytest.mark.parametrize("stage", [0, 1, 3])
def test_zero_optimizers_are_deepspeed_optimizers(solo: None, stage: int) -> None:
    from deepspeed.runtime.base_optimizer import DeepSpeedOptimizer, ZeROOptimizer

    engine, optimizer, _, _ = dsrun.initialize(model=torch.nn.Linear(4, 2), config={
        "train_batch_size": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "zero_optimization": {"stage": stage}})
    if stage == 0:  # a torch optimizer: Fabric's other branch
        assert isinstance(optimizer, torch.optim.Optimizer)
        assert not isinstance(optimizer, DeepSpeedOptimizer)
    else:
        assert isinstance(optimizer, ZeROOptimizer) and isinstance(optimizer, DeepSpeedOptimizer)
    assert not isinstance(object(), DeepSpeedOptimizer)
