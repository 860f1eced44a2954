"""bench/losscheck.py: the benches' check that every runner trained the same thing."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest

PATH = Path(__file__).resolve().parents[2] / "bench" / "losscheck.py"
spec = importlib.util.spec_from_file_location("bench_losscheck", PATH)
assert spec is not None and spec.loader is not None
losscheck = importlib.util.module_from_spec(spec)
spec.loader.exec_module(losscheck)

SAME = [42.904667, 42.369461, 41.830467]


def test_equal_losses_and_reduction_order_noise_agree():
    noisy = [v * (1 + 3e-7) for v in SAME]  # fp32 reduction-order differences
    assert losscheck.mismatches({"ddp": SAME, "dsrun-stage3": noisy}) == []


def test_a_runner_whose_losses_differ_is_named_with_the_step():
    other = [SAME[0], SAME[1] + 0.05, SAME[2]]  # one step trained differently
    found = losscheck.mismatches({"ddp": SAME, "dsrun-stage0": SAME, "dsrun-stage3": other})
    assert len(found) == 1
    assert "dsrun-stage3 step 1" in found[0] and "ddp" in found[0]


def test_missing_steps_and_nan_are_differences():
    found = losscheck.mismatches({"a": SAME, "b": SAME[:2], "c": [SAME[0], math.nan, SAME[2]]})
    assert [line.split()[0].rstrip(":") for line in found] == ["b", "c"]


def test_check_prints_the_verdict_and_exit_on_names_the_runners(capsys):
    found = losscheck.check({"ddp": SAME, "fsdp2": [1.0, 2.0, 3.0]}, "train losses")
    out = capsys.readouterr().out
    assert "MISMATCH" in out and "relative tolerance 0.0001" in out and "fsdp2" in out
    with pytest.raises(SystemExit, match="fsdp2"):
        losscheck.exit_on(found)
    assert losscheck.check({"ddp": SAME, "fsdp2": SAME}) == []
    assert "all agree" in capsys.readouterr().out
    losscheck.exit_on([])  # nothing differs: no exit


def test_a_broken_first_runner_is_the_one_named():
    broken = [SAME[0], SAME[1] * 1.2, SAME[2] * 1.5]  # trained something else
    found = losscheck.mismatches({"ddp round 1": broken, "dsrun round 1": SAME,
                                  "fsdp2 round 1": SAME})
    assert len(found) == 1
    assert found[0].startswith("ddp round 1 step 1:") and "dsrun round 1" in found[0]
    assert "majority" not in found[0]


def test_with_no_majority_the_reference_may_be_the_odd_one(capsys):
    found = losscheck.mismatches({"a": SAME, "b": [v + 1 for v in SAME],
                                  "c": [v + 2 for v in SAME]})
    assert len(found) == 2 and all("a may be the odd one" in line for line in found)
    assert losscheck.mismatches({"a": SAME, "b": [v + 1 for v in SAME]}) == [
        f"b step 0: loss {SAME[0] + 1!r}, a: {SAME[0]!r}"]  # two: the line names both
    losscheck.check({"x": [1.0], "y": SAME, "z": SAME})
    assert "compared with y" in capsys.readouterr().out


def test_runners_that_agree_but_never_change_are_named(capsys):
    flat = [SAME[0]] * 3  # every runner agrees: nobody trained
    found = losscheck.check({"ddp": flat, "dsrun": [v * (1 + 1e-7) for v in flat]})
    assert len(found) == 2 and all("nothing was trained" in line for line in found)
    assert "MISMATCH" in capsys.readouterr().out
    assert losscheck.stalled({"ddp": SAME, "one step": SAME[:1]}) == []


def test_fewer_than_two_steps_is_said(capsys):
    assert losscheck.check({"ddp": SAME[:1], "dsrun": SAME[:1]}) == []
    assert "ddp, dsrun recorded fewer than two steps" in capsys.readouterr().out
