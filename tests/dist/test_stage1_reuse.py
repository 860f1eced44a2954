"""ZeRO stage 1 without gradient accumulation trains a parameter that gets
several gradients in one backward (a block shared by two reentrant
checkpoints, a tied embedding/head, a Linear inside and outside a
checkpoint, a block applied a different number of times on each rank), as
DeepSpeed 0.19.8's stage 1 does: parameters within 1e-6 of plain torch,
losses equal to stage 0's (workers/stage1_reuse.py: one 2-rank dsrun job).

Before: stage 1 reduced each gradient once per backward, as stage 2 does,
and refused the second ("received gradients twice in one backward pass").
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.conftest import ROOT, rank_results
from tests.dist.workers import stage1_reuse as worker

pytestmark = pytest.mark.dist

WORKER = ROOT / "tests" / "dist" / "workers" / "stage1_reuse.py"
TOLERANCE = 1e-6


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out = tmp_path_factory.mktemp("stage1_reuse")
    return rank_results(WORKER, out, 2, timeout=240, env={"OMP_NUM_THREADS": "1"})


@pytest.mark.parametrize("name", [n for n in worker.RUNS if n.startswith("s1_")])
def test_stage1_sums_every_gradient_of_a_reused_parameter(job: list[dict[str, Any]],
                                                          name: str) -> None:
    case = worker.RUNS[name][0]
    for result in job:
        run = result["runs"][name]
        assert "error" not in run, f"{name}, rank {result['rank']}: {run['error']}"
        want = result["reference"][case]
        diff = max(abs(a - b) for n in want
                   for a, b in zip(run["params"][n], want[n], strict=True))
        assert diff <= TOLERANCE, f"{name}, rank {result['rank']}: {diff:.3g} from plain torch"


def test_stage1_losses_are_stage0s(job: list[dict[str, Any]]) -> None:
    for result in job:
        stage0 = result["runs"]["s0_shared_small_buckets"]["losses"]
        for name in ("s1_shared", "s1_shared_small_buckets"):
            got = result["runs"][name]["losses"]
            assert got == pytest.approx(stage0, abs=1e-6), (name, got, stage0)
