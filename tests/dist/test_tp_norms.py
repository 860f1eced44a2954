"""Tensor parallelism through a Megatron-style ``mpu`` (TP=2 x DP=2, one
4-rank dsrun job, ``workers/tp_norm_cases.py``): the step's gradient norm
is the whole model's (split parameters counted on every tensor-parallel
rank, replicated ones once), so clipping equals the unsplit model's and
the replicated weights stay identical on both ranks of a tensor-parallel
pair; an inf in one rank's shard makes every rank skip the step, at ZeRO
stages 0-3, in fp32, fp16 and bf16, offload included."""

from __future__ import annotations

from typing import Any

import pytest

from tests.conftest import ROOT, rank_results

pytestmark = pytest.mark.dist

WORKER = ROOT / "tests" / "dist" / "workers" / "tp_norm_cases.py"
REPLICATED = ("ln.weight", "ln.bias", "b2", "head")
D, H = 4, 8


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return rank_results(WORKER, tmp_path_factory.mktemp("tp"), world=4, timeout=300)


def _slice(name: str, whole: list[float], tp_rank: int) -> list[float]:
    """This tensor-parallel rank's part of the unsplit parameter ``name`` (flat)."""
    if name in ("w1", "b1"):
        width = len(whole) // 2
        return whole[tp_rank * width:(tp_rank + 1) * width]
    rows = [whole[r * H:(r + 1) * H] for r in range(D)]  # w2 is (D, H), cut along H
    return [v for row in rows for v in row[tp_rank * H // 2:(tp_rank + 1) * H // 2]]


def _pairs(results: list[dict[str, Any]]) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    return [(results[0], results[1]), (results[2], results[3])]


def test_norm_and_clipping_equal_the_unsplit_models(results: list[dict[str, Any]]) -> None:
    for rank, result in enumerate(results):
        for name, case in result["cases"].items():
            if not name.startswith("norm-"):
                continue
            assert case["norms"] == pytest.approx(result["ref_norms"], rel=1e-5), (rank, name)
            assert all(case["applied"]), (rank, name)
            for param, got in case["values"].items():
                whole = result["ref_values"][param]
                want = whole if param in REPLICATED else _slice(param, whole, result["tp_rank"])
                assert got == pytest.approx(want, rel=1e-5, abs=1e-6), (rank, name, param)


def test_replicated_weights_stay_identical_across_the_tensor_parallel_pair(
        results: list[dict[str, Any]]) -> None:
    for first, second in _pairs(results):
        for name, case in first["cases"].items():
            other = second["cases"][name]
            for param in REPLICATED:
                assert case["values"][param] == other["values"][param], (name, param)
            assert case["norms"] == other["norms"], name


def test_an_inf_in_one_shard_skips_the_step_on_every_rank(
        results: list[dict[str, Any]]) -> None:
    for rank, result in enumerate(results):
        for name, case in result["cases"].items():
            if not name.startswith("skip-"):
                continue
            assert case["applied"] == [True, True, False], (rank, name)
            assert case["skipped"] == 1, (rank, name)
            # the steps before, in 16 bits: the whole model's norm too
            assert case["norms"][:2] == pytest.approx(result["ref_norms"][:2], rel=1e-2), \
                (rank, name)
