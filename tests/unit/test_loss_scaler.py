"""The fp16 loss-scale state machine, as pure code."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dsrun.runtime.loss_scaler import LossScaleError, LossScaler


def run(scaler: LossScaler, overflows: str) -> list[tuple[bool, float]]:
    """Feed 'x' (overflow) / '.' (clean) steps; (skipped, scale after) per step."""
    return [(scaler.update(c == "x"), scaler.scale) for c in overflows]


def test_overflow_without_hysteresis_skips_and_halves() -> None:
    scaler = LossScaler(scale=1024.0, hysteresis=1, window=100)
    assert run(scaler, "x.x") == [(True, 512.0), (False, 512.0), (True, 256.0)]
    assert scaler.overflows == 2


def test_hysteresis_delays_the_shrink_but_every_overflow_skips() -> None:
    scaler = LossScaler(scale=1024.0, hysteresis=2, window=100)
    # first overflow spends hysteresis (no shrink), second shrinks, third shrinks again
    assert run(scaler, "xxx") == [(True, 1024.0), (True, 512.0), (True, 256.0)]


def test_hysteresis_is_refilled_only_at_growth_unless_consecutive() -> None:
    plain = LossScaler(scale=1024.0, hysteresis=2, window=100)
    assert run(plain, "x.x")[-1] == (True, 512.0)  # budget not refilled by one clean step
    consecutive = LossScaler(scale=1024.0, hysteresis=2, window=100, consecutive_hysteresis=True)
    assert run(consecutive, "x.x")[-1] == (True, 1024.0)  # refilled: the shrink is delayed again


def test_growth_after_window_clean_steps_from_start_and_after_overflow() -> None:
    scaler = LossScaler(scale=8.0, hysteresis=1, window=3)
    scales = [scale for _, scale in run(scaler, "....")]
    assert scales == [8.0, 8.0, 8.0, 16.0]  # grows on the 4th clean step, as DeepSpeed
    scales = [scale for _, scale in run(scaler, "x....")]
    assert scales == [8.0, 8.0, 8.0, 8.0, 16.0]  # 3 clean steps after the overflow don't count it


def test_growth_refills_hysteresis() -> None:
    scaler = LossScaler(scale=64.0, hysteresis=2, window=2)
    run(scaler, "x..")  # overflow spends hysteresis; 2 clean steps are not yet a growth
    assert scaler.scale == 64.0 and scaler.hysteresis_left == 1
    run(scaler, ".")  # the third grows and refills
    assert scaler.scale == 128.0 and scaler.hysteresis_left == 2


def deepspeed_scales(steps: str, scale: float, window: int, hysteresis: int,
                     consecutive: bool) -> list[float]:
    """DeepSpeed 0.19.8's DynamicLossScaler.update_scale, restated: the scale
    after each step ('x' overflow, '.' clean)."""
    cur_iter, last_overflow, cur_hysteresis, out = 0, -1, hysteresis, []
    for c in steps:
        if c == "x":
            if hysteresis == 1 or cur_hysteresis == 1:
                scale = max(scale / 2, 1.0)
            else:
                cur_hysteresis -= 1
            last_overflow = cur_iter
        else:
            if consecutive:
                cur_hysteresis = hysteresis
            stable_interval = (cur_iter - last_overflow) - 1
            if stable_interval > 0 and stable_interval % window == 0:
                if not consecutive:
                    cur_hysteresis = hysteresis
                scale *= 2
        cur_iter += 1
        out.append(scale)
    return out


@given(st.text(alphabet="x.", max_size=60), st.integers(1, 4), st.integers(1, 5),
       st.booleans())
def test_scales_are_deepspeeds(steps: str, hysteresis: int, window: int,
                               consecutive: bool) -> None:
    scaler = LossScaler(scale=2.0**20, hysteresis=hysteresis, window=window, min_scale=1.0,
                        raise_at_min_scale=False, consecutive_hysteresis=consecutive)
    assert [scale for _, scale in run(scaler, steps)] == \
        deepspeed_scales(steps, 2.0**20, window, hysteresis, consecutive)


def test_min_scale_clamps_then_raises_like_deepspeed() -> None:
    scaler = LossScaler(scale=4.0, hysteresis=1, window=100, min_scale=2.0)
    assert run(scaler, "x") == [(True, 2.0)]
    with pytest.raises(LossScaleError, match="minimum loss scale 2"):
        scaler.update(True)


def test_min_scale_without_raising_keeps_skipping() -> None:
    scaler = LossScaler(scale=4.0, hysteresis=1, window=100, min_scale=3.0,
                        raise_at_min_scale=False)
    assert run(scaler, "xxx") == [(True, 3.0), (True, 3.0), (True, 3.0)]


def test_static_scale_never_changes_but_skips_overflows() -> None:
    scaler = LossScaler(scale=128.0, dynamic=False, window=1)
    assert run(scaler, ".x..") == [(False, 128.0), (True, 128.0), (False, 128.0), (False, 128.0)]
    assert scaler.overflows == 1


@pytest.mark.parametrize("bad", [dict(scale=0.0), dict(window=0), dict(hysteresis=0),
                                 dict(scale=1.0, min_scale=2.0)])
def test_invalid_settings(bad: dict) -> None:
    with pytest.raises(ValueError):
        LossScaler(**bad)


@given(st.text(alphabet="x.", max_size=60), st.integers(1, 4), st.integers(1, 5))
def test_invariants(steps: str, hysteresis: int, window: int) -> None:
    scaler = LossScaler(scale=2.0**20, hysteresis=hysteresis, window=window, min_scale=1.0,
                        raise_at_min_scale=False)
    clean_run = 0
    for c in steps:
        before = scaler.scale
        skipped = scaler.update(c == "x")
        assert skipped == (c == "x")  # every overflow skips, nothing else does
        clean_run = 0 if c == "x" else clean_run + 1
        if c == "x":
            assert scaler.scale in (before, max(before / 2, 1.0))
        else:  # the first clean step after an overflow (or the start) does not count
            grew = clean_run > 1 and (clean_run - 1) % window == 0
            assert scaler.scale == (before * 2 if grew else before)
        assert 1 <= scaler.hysteresis_left <= hysteresis
