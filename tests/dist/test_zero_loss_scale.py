"""DeepSpeed's ``cur_scale`` / ``loss_scale`` on dsrun's ZeRO optimizers:
the linked fp16 loss scaler's current scale, 1.0 without one."""

from __future__ import annotations

import pytest
import torch

from dsrun.runtime.config_sections import ZeroConfig
from dsrun.runtime.loss_scaler import LossScaler
from dsrun.runtime.zero.stepping import wrap_optimizer

pytestmark = pytest.mark.dist


def test_cur_scale_follows_the_linked_scaler(solo: None) -> None:
    model = torch.nn.Linear(4, 2)
    plain = wrap_optimizer(torch.optim.SGD(model.parameters(), lr=0.1), ZeroConfig(stage=2),
                           2, None, model)
    assert plain.cur_scale == plain.loss_scale == 1.0
    scaler = LossScaler(scale=2.0**12)
    model = torch.nn.Linear(4, 2)
    scaled = wrap_optimizer(torch.optim.SGD(model.parameters(), lr=0.1), ZeroConfig(stage=1),
                            1, None, model, loss_scaler=scaler)
    assert scaled.cur_scale == scaled.loss_scale == 4096.0
    scaler.update(True)  # an overflow: hysteresis 2 keeps the scale once
    scaler.update(True)
    assert scaled.cur_scale == scaler.scale == 2048.0
