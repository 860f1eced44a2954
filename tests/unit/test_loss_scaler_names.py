"""DeepSpeed's ``DynamicLossScaler`` attribute names on dsrun's
:class:`~dsrun.runtime.loss_scaler.LossScaler`: each reads the live state,
and a write is what the next :meth:`update` acts on."""

from __future__ import annotations

import pytest

from dsrun.runtime.loss_scaler import LossScaleError, LossScaler


def test_names_read_the_live_state() -> None:
    scaler = LossScaler(scale=64.0, window=3, hysteresis=2, min_scale=2.0)
    scaler.update(True)
    assert (scaler.cur_scale, scaler.loss_scale, scaler.cur_hysteresis) == (64.0, 64.0, 1)
    assert (scaler.cur_iter, scaler.last_overflow_iter) == (1, 0)
    assert (scaler.scale_window, scaler.delayed_shift, scaler.min_scale) == (3, 2, 2.0)
    assert scaler.raise_error_at_min_scale and scaler.dynamic


def test_a_written_window_and_iteration_decide_the_next_growth() -> None:
    scaler = LossScaler(scale=8.0, window=1000)
    scaler.scale_window = 2
    scaler.cur_iter, scaler.last_overflow_iter = 10, 7  # stable interval 2 at this update
    scaler.update(False)
    assert scaler.cur_scale == 16.0 and scaler.window == 2 and scaler.iteration == 11


def test_written_hysteresis_and_min_scale_rules_decide_an_overflow() -> None:
    scaler = LossScaler(scale=4.0, hysteresis=3, min_scale=4.0)
    scaler.cur_hysteresis = 1  # no budget left: this overflow is at the floor
    with pytest.raises(LossScaleError):
        scaler.update(True)
    scaler.raise_error_at_min_scale = False
    assert not scaler.raise_at_min_scale and scaler.update(True) and scaler.cur_scale == 4.0
    scaler.delayed_shift = 5
    scaler.cur_scale = 32.0
    scaler.update(True)
    assert scaler.cur_scale == 16.0 and scaler.hysteresis == 5


@pytest.mark.parametrize("bad", [0, -2.0, float("nan"), "x"])
def test_a_bad_scale_is_refused_naming_it(bad: object) -> None:
    scaler = LossScaler(scale=8.0)
    with pytest.raises(ValueError, match=r"loss_scaler.cur_scale = "):
        scaler.cur_scale = bad  # type: ignore[assignment]
    assert scaler.scale == 8.0


def test_loss_scale_is_read_only_as_in_deepspeed() -> None:
    scaler = LossScaler(scale=8.0)
    with pytest.raises(AttributeError):
        scaler.loss_scale = 4.0  # type: ignore[misc]
