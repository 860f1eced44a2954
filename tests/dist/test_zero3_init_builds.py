"""Builds under ``zero.Init`` that touch children already partitioned, on 2
gloo ranks (one dsrun job, workers/zero3_init_builds.py; every parameter
partitioned):

* ``nn.TransformerEncoder`` deep-copies its built layer: it builds (was
  refused: "cannot copy.deepcopy"), its parameters equal plain torch's and
  it trains as plain torch does;
* ``nn.MultiheadAttention`` zeroes its built ``out_proj.bias``: it is 0, as
  in plain torch (was Linear's random bias - also in DeepSpeed 0.19.8);
* a parent's ``trunc_normal_``/``zeros_`` on a built child, and the child
  built after it, equal plain torch's;
* ``copy.deepcopy(model)`` inside the ``with`` block is a partitioned copy
  (new ids, released, the same values);
* ``zeros_``/``mul_`` on a released parameter after ``initialize()`` are
  refused naming it (did nothing), and leave it unchanged.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.conftest import ROOT, rank_results

pytestmark = pytest.mark.dist

WORKER = ROOT / "tests" / "dist" / "workers" / "zero3_init_builds.py"


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out = tmp_path_factory.mktemp("zero3_init_builds")
    return rank_results(WORKER, out, 2, timeout=240, env={"OMP_NUM_THREADS": "1"})


def ok(result: dict[str, Any]) -> Any:
    assert "ok" in result, result
    return result["ok"]


def test_transformer_encoder_built_under_init_trains_as_torch(
        job: list[dict[str, Any]]) -> None:
    for result in job:
        encoder = ok(result["encoder"])
        assert encoder["params"] == 0.0
        assert encoder["losses"]["engine"] == pytest.approx(encoder["losses"]["plain"],
                                                            rel=1e-5, abs=1e-7)


@pytest.mark.parametrize("case", ["mha", "trunc_normal"])
def test_init_writes_to_a_built_child_equal_torch(job: list[dict[str, Any]],
                                                  case: str) -> None:
    for result in job:
        diffs = ok(result[case])
        assert diffs and all(d == 0.0 for d in diffs.values()), diffs


def test_deepcopy_inside_init_is_a_partitioned_copy(job: list[dict[str, Any]]) -> None:
    for result in job:
        assert ok(result["twin"]) == {"new_ids": True, "released": True, "diff": 0.0}


@pytest.mark.parametrize("write", ["zeros_", "mul_"])
def test_writes_to_a_released_parameter_after_initialize_are_refused(
        job: list[dict[str, Any]], write: str) -> None:
    for result in job:
        out = result["write_outside"]
        assert out[write].get("error") == "ReleasedParameterError", out[write]
        action = "zero_" if write == "zeros_" else write
        assert f"cannot {action} 0.weight of shape (6, 4)" in out[write]["message"]
        assert "modifier_rank=0" in out[write]["message"]
        assert out["unchanged"]
