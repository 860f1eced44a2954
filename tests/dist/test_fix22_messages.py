"""Small engine behaviours on a one-rank engine in this process (``solo``):

* the optimizer-state errors of ``dsrun.utils``' per-parameter API name the
  parameter by its module name at stages 0-2 too (before: only stage 3,
  whose parameters carry ``ds_name``; the others said "a parameter of
  shape (3, 5)");
* stage 0: ``optimizer.cur_scale`` / ``loss_scale`` show a write to
  ``optimizer.loss_scaler.cur_scale`` at once, as DeepSpeed's fp16
  optimizer (whose ``cur_scale`` is its scaler's) does (before: the old
  scale until the next backward).
"""

from __future__ import annotations

import pytest
import torch

from dsrun.errors import DsrunError
from dsrun.utils import safe_get_full_optimizer_state
from tests.dist.test_loss_scale_writes import build, train_step
from tests.dist.test_param_access_outside import engine_for

pytestmark = pytest.mark.dist


@pytest.mark.parametrize("stage", (0, 1, 2, 3))
def test_state_errors_name_the_parameter(solo: None, stage: int) -> None:
    engine, m = engine_for(stage, only_first=False)
    engine.backward(engine(torch.randn(2, 6)).pow(2).sum())
    engine.step()
    with pytest.raises(DsrunError, match=r"keeps no state 'bogus' for 2\.weight"):
        safe_get_full_optimizer_state(m[2].weight, "bogus")
    with pytest.raises(DsrunError, match=r"optimizer state 'step' of 2\.weight is not one value"):
        safe_get_full_optimizer_state(m[2].weight, "step")


def test_stage0_cur_scale_shows_a_scaler_write_at_once(solo: None) -> None:
    engine = build(0)
    opt = engine.optimizer
    train_step(engine)
    opt.loss_scaler.cur_scale = 8.0
    assert opt.cur_scale == opt.loss_scale == 8.0
    opt.cur_scale = 4.0  # the optimizer's own attribute, then the scaler's again
    opt.loss_scaler.cur_scale = 2.0
    assert opt.cur_scale == opt.loss_scale == opt.loss_scaler.cur_scale == 2.0
    train_step(engine)
    assert engine.precision.loss_scale == 2.0


@pytest.mark.parametrize("stage", (1, 2, 3))
def test_add_param_group_at_zero_names_the_stage_and_the_way_out(solo: None,
                                                                  stage: int) -> None:
    """As in DeepSpeed 0.19.8, the ZeRO optimizer has no ``add_param_group``
    (``hasattr`` False, an AttributeError), but the error says why and what
    to do (before: torch's bare "object has no attribute")."""
    engine, m = engine_for(stage, only_first=True)
    assert not hasattr(engine.optimizer, "add_param_group")
    with pytest.raises(AttributeError, match=f"not supported at ZeRO stage {stage}.*stage 0"):
        engine.optimizer.add_param_group({"params": list(m[2].parameters())})


@pytest.mark.parametrize("loader_batch", (4, 8))
def test_a_dataloader_of_another_batch_size_is_warned_of(
        solo: None, loader_batch: int, caplog: pytest.LogCaptureFixture) -> None:
    """DeepSpeed counts the configured micro batch whatever the script
    feeds (and refuses a DataLoader as ``training_data``); dsrun takes the
    script's DataLoader as it is, so it says once, with both numbers, that
    ``global_samples`` counts the config's (before: nothing)."""
    import logging

    import dsrun

    model = torch.nn.Linear(3, 1)
    data = torch.utils.data.TensorDataset(torch.randn(16, 3))
    loader = torch.utils.data.DataLoader(data, batch_size=loader_batch)
    with caplog.at_level(logging.WARNING, logger="dsrun"):
        engine, _, got, _ = dsrun.initialize(model=model, training_data=loader, config={
            "train_micro_batch_size_per_gpu": 4,
            "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
    assert got is loader
    warned = [r.getMessage() for r in caplog.records if "batch_size is" in r.getMessage()]
    if loader_batch == 4:
        assert not warned
    else:
        assert len(warned) == 1 and "batch_size is 8" in warned[0]
        assert "train_micro_batch_size_per_gpu is 4" in warned[0]
    engine.destroy()


@pytest.mark.parametrize("stage", (1, 2, 3))
def test_bf16_zero_optimizer_has_deepspeeds_unit_loss_scaler(solo: None, stage: int) -> None:
    """DeepSpeed 0.19.8's ZeRO optimizers hold ``LossScaler(scale=1.0)``
    under bf16 (checked with bench/.venv-ds): ``optimizer.loss_scaler
    .cur_scale`` reads 1.0 (before: ``loss_scaler`` was None, and the read
    an AttributeError); a write is refused, as the optimizer's own is."""
    engine = build(stage, precision="bf16")
    opt = engine.optimizer
    scaler = opt.loss_scaler
    assert scaler is not None
    assert scaler.cur_scale == scaler.loss_scale == opt.cur_scale == 1.0
    assert not opt.dynamic_loss_scale
    with pytest.raises(DsrunError, match="no loss scaling"):
        scaler.cur_scale = 8.0
    x = torch.full((1, 4), 0.5)
    engine.backward(engine(x).float().sum())
    engine.step()
    assert engine.was_step_applied() and scaler.cur_scale == opt.cur_scale == 1.0
