"""On 2 gloo ranks (``workers/comm_utils_cases.py``, one launch):
``deepspeed.comm``'s reductions take DeepSpeed's ``ReduceOp``
(``deepspeed.comm.reduce_op``); ``deepspeed.runtime.utils``'s norm helpers
with an mpu equal torch's norms of the whole model (the flattened gradient
norm counting replicated parameters on every rank, as DeepSpeed's does);
``PartitionedTensor`` keeps each rank's part and gathers the whole back,
also from its meta, for an even and an uneven split;
``get_all_ranks_from_group`` answers a group's members also on a rank
outside it, as DeepSpeed's; ``inference_all_reduce`` returns its tensor."""

from __future__ import annotations

from typing import Any

import pytest

from tests.conftest import ROOT, rank_results

pytestmark = pytest.mark.dist


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out = tmp_path_factory.mktemp("comm_utils")
    return rank_results(ROOT / "tests" / "dist" / "workers" / "comm_utils_cases.py", out,
                        world=2, timeout=180)


def test_reductions_take_deepspeeds_reduce_op(results: list[dict[str, Any]]) -> None:
    for rank in results:
        assert rank["reductions"]["got"] == rank["reductions"]["expected"]


def test_norms_over_the_model_parallel_group(results: list[dict[str, Any]]) -> None:
    for rank in results:
        got, expected = rank["norms"]["got"], rank["norms"]["expected"]
        assert set(got) == set(expected)
        for name, value in expected.items():
            assert got[name] == pytest.approx(value, rel=1e-5), name
    assert results[0]["norms"]["got"] == results[1]["norms"]["got"]  # the same on every rank


def test_partitioned_tensor_round_trip(results: list[dict[str, Any]]) -> None:
    for rank_id, rank in enumerate(results):
        for numel, facts in rank["partitioned"].items():
            assert facts["full"] and facts["rebuilt_full"], (rank_id, numel)
            assert facts["local"] == facts["expected_local"], (rank_id, numel)
    assert results[0]["partitioned"]["7"]["partition"] == [0, 4, 7]  # the first part longer
    assert all(rank["is_parallel"] for rank in results)


def test_group_members_on_every_rank(results: list[dict[str, Any]]) -> None:
    for rank in results:
        facts = rank["groups"]
        # new_group([1]) was made last without rank 0, new_group([0]) without
        # rank 1: torch's record of each rank's non-member sentinel
        assert (facts["only0"], facts["only1"]) == ([0], [1])
        assert facts["both"] == [0, 1] and facts["world"] == [0, 1]
        assert facts["inference_returned_tensor"] and facts["inference_sum"] == [3.0]
