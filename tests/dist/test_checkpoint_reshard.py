"""Loading at another world size and ZeRO stage, optimizer state included.

The worker feeds every step the same global batch of 12 samples whatever the
world size (each rank takes its slice of each micro-batch), so a run at any
world size follows the same loss curve up to rounding. Checkpoints:

* A - saved by 2 ranks at stage 2 after 3 steps;
* B - saved by 3 ranks at stage 3 after 3 steps.

Loads (new processes, another initialisation): A at 3 ranks stage 3, A at
1 rank stage 0, B at 2 ranks stage 1. Each continues 4 steps on the loss
curve of the run that saved, within 1e-5 (Adam's first steps after a
reload would differ at the 1e-2 level without the optimizer state).
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.dist.test_checkpoint_resume import job
from tests.dist.test_engine_dist import _run

pytestmark = pytest.mark.dist
TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def curves(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    ckpt = tmp_path_factory.mktemp("reshard_ckpt")

    def run(ranks: int, *specs: str) -> list[dict[str, Any]]:
        out = tmp_path_factory.mktemp("reshard")
        argv = ["--mode", "reshard", "--out", str(out), "--ckpt", str(ckpt)]
        for spec in specs:
            argv += ["--run", spec]
        results = _run(job(ranks, *argv), out)
        assert [r["world_size"] for r in results] == [ranks] * ranks
        return results[0]["runs"]

    saved_a = run(2, "2:save=A")[0]
    saved_b, a_at_3 = run(3, "3:save=B", "3:load=A")
    b_at_2 = run(2, "1:load=B")[0]
    a_at_1 = run(1, "0:load=A")[0]
    return {"A": saved_a, "B": saved_b, "A->3 ranks stage 3": a_at_3,
            "B->2 ranks stage 1": b_at_2, "A->1 rank stage 0": a_at_1, "ckpt": ckpt}


def assert_follows(loaded: dict[str, Any], saved: dict[str, Any]) -> None:
    assert loaded["start"] == 3
    expected = saved["losses"][3:]
    assert len(loaded["losses"]) == len(expected) == 4
    for got, want in zip(loaded["losses"], expected):
        assert abs(got - want) <= TOLERANCE, (loaded["losses"], expected)


def test_the_two_saving_runs_follow_one_curve(curves: dict[str, Any]) -> None:
    for a, b in zip(curves["A"]["losses"], curves["B"]["losses"]):
        assert abs(a - b) <= TOLERANCE


def test_two_ranks_stage2_to_three_ranks_stage3(curves: dict[str, Any]) -> None:
    assert_follows(curves["A->3 ranks stage 3"], curves["A"])


def test_two_ranks_stage2_to_one_rank_stage0(curves: dict[str, Any]) -> None:
    assert_follows(curves["A->1 rank stage 0"], curves["A"])


def test_three_ranks_stage3_to_two_ranks_stage1(curves: dict[str, Any]) -> None:
    assert_follows(curves["B->2 ranks stage 1"], curves["B"])


def test_manifests_record_who_saved(curves: dict[str, Any]) -> None:
    a = json.loads((curves["ckpt"] / "A" / "manifest.json").read_text())
    b = json.loads((curves["ckpt"] / "B" / "manifest.json").read_text())
    assert (a["world_size"], a["meta"]["zero_stage"]) == (2, 2)
    assert (b["world_size"], b["meta"]["zero_stage"]) == (3, 3)
    assert a["tensors"].keys() == b["tensors"].keys()
    assert set(a["tensors"]["mid.weight"]["items"]) == {"value", "exp_avg", "exp_avg_sq"}
