"""fp16 pipelines skip a step whose gradient, summed over the micro-batches,
leaves float16's range - whatever holds the sum: the module's float16
gradients (ZeRO 0-1) or ZeRO-2's fp32 partition accumulators (here with
optimizer offload at world size 1), as a float16 accumulation and
DeepSpeed do (runtime/pipe/step.py, runtime/zero/masters.py)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn as nn

import dsrun
from dsrun.pipe import LayerSpec, PipelineModule

pytestmark = pytest.mark.dist


class Amplify(nn.Module):
    """Each micro-step's weight gradient is 25000 x scale / 2 per element:
    50000 at loss scale 4 (finite in float16), their sum 100000 (not)."""

    def forward(self, y: torch.Tensor) -> torch.Tensor:
        return y.float() * 25000.0


@pytest.mark.parametrize("zero", [{"stage": 0}, {"stage": 1},
                                  {"stage": 2, "offload_optimizer": {"device": "cpu"}}])
def test_a_micro_step_sum_beyond_float16_is_an_overflow(solo: None, zero: dict[str, Any]
                                                        ) -> None:
    torch.manual_seed(0)
    module = PipelineModule([LayerSpec(nn.Linear, 4, 4, bias=False), LayerSpec(Amplify)],
                            num_stages=1, loss_fn=lambda out, labels: out.sum())
    engine, *_ = dsrun.initialize(model=module, config={
        "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-9}}, "gradient_clipping": 0.0,
        "fp16": {"enabled": True, "initial_scale_power": 2, "hysteresis": 1,
                 "min_loss_scale": 1},
        "zero_optimization": zero})
    batch = (torch.ones(1, 4, dtype=torch.float16), torch.zeros(1))
    engine.train_batch(iter([batch, batch]))
    assert engine.skipped_steps == 1
    assert engine.precision.loss_scale == 2.0  # halved, as on any overflow
    engine.destroy()
