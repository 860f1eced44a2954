"""ZeRO stages 1 and 2 reduce gradients during backward in one round per
backward, ended when the outermost backward pass ends - also when the
backward's first gradient arrives in a reentrant activation checkpoint's
nested pass (the head inside the last checkpoint) and the ranks run
different numbers of checkpoints (workers/zero_nested_rounds.py: one 2-rank
dsrun job). Parameters within 1e-6 of plain torch; each backward launches
every bucket once and ends one round, the same on every rank.

Before: the round ended with the first nested pass that delivered a
gradient, so a backward ran one round per checkpoint after it: every
bucket sent several times, and ranks with different numbers of
checkpoints ran different collectives (gloo: "Is there a distributed
collective mismatch", the job aborted; NCCL: a hang). ``s1_late_reuse``
(a block first reused in the second backward, by one rank): refused on
that rank alone, the other left in the round's collectives - now summed
on CPU and, where the ranks stop agreeing on extra gradients (an
accelerator, simulated), refused on every rank at the next backward.

Also a backward driven outside the engine (``engine.module(x)``, then
``loss.backward()``) whose gradients all arrive in reentrant checkpoints'
nested passes: it ends its own round (before: the round stayed open into
the next micro-step - stage 2: a false "received gradients twice").
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.conftest import ROOT, rank_results
from tests.dist.workers import zero_nested_rounds as worker

pytestmark = pytest.mark.dist

WORKER = ROOT / "tests" / "dist" / "workers" / "zero_nested_rounds.py"
TOLERANCE = 1e-6


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out = tmp_path_factory.mktemp("zero_nested_rounds")
    return rank_results(WORKER, out, 2, timeout=240, env={"OMP_NUM_THREADS": "1"})


TRAINED = [name for name in worker.RUNS
           if not name.endswith("_unwatched") and not name.endswith("_refused")]


@pytest.mark.parametrize("name", TRAINED)
def test_trains_as_plain_torch(job: list[dict[str, Any]], name: str) -> None:
    case = worker.RUNS[name][0]
    for result in job:
        run = result["runs"][name]
        assert "error" not in run, f"{name}, rank {result['rank']}: {run['error']}"
        want = result["reference"][case]
        diff = max(abs(a - b) for n in want
                   for a, b in zip(run["params"][n], want[n], strict=True))
        assert diff <= TOLERANCE, f"{name}, rank {result['rank']}: {diff:.3g} from plain torch"


@pytest.mark.parametrize("name", TRAINED)
def test_one_round_per_backward(job: list[dict[str, Any]], name: str) -> None:
    """Every bucket launched once per backward, one round end, and the same
    small all-reduces (the stage-1 extras agreement) on both ranks."""
    runs = [result["runs"][name] for result in job]
    for rank, run in enumerate(runs):
        assert run["buckets"] > 0
        for step, counts in enumerate(run["per_backward"]):
            assert (counts["launch"], counts["round"]) == (run["buckets"], 1), \
                f"{name}, rank {rank}, backward {step}: {counts}"
    assert [[c["all_reduce"] for c in run["per_backward"]] for run in runs].count(
        [c["all_reduce"] for c in runs[0]["per_backward"]]) == len(runs)


def test_late_reuse_refused_on_every_rank_where_unwatched(job: list[dict[str, Any]]) -> None:
    """The ranks stopped agreeing on extra gradients after a first backward
    without any (as on an accelerator); rank 1 reuses a block in the second:
    every rank raises the same error when the third starts (the job goes
    on to the next run: no rank was left in a collective)."""
    runs = [result["runs"]["s1_late_reuse_unwatched"] for result in job]
    for run in runs:
        assert "received gradients twice" in run.get("error", ""), run
        assert "on some rank, in the last backward" in run["error"]
        assert len(run["per_backward"]) == 2, run["per_backward"]
    assert runs[0]["error"] == runs[1]["error"]


def test_stage2_refuses_a_tied_head_inside_the_last_checkpoint(job: list[dict[str, Any]]
                                                               ) -> None:
    """Both gradients of the tied weight now fall in one round, so stage 2
    refuses it as it does with the head outside the checkpoint (before: a
    second round took the outer gradient, every bucket sent twice)."""
    for result in job:
        run = result["runs"]["s2_tied_refused"]
        assert "received gradients twice in one backward pass" in run.get("error", ""), run
        assert run["per_backward"] == [], run["per_backward"]


@pytest.mark.parametrize("stage,ga", worker.DIRECT)
def test_backward_outside_the_engine_ends_its_round(job: list[dict[str, Any]], stage: int,
                                                    ga: int) -> None:
    """``engine.module(x)`` then ``loss.backward()`` (no engine forward, so
    no engine ``finish()``), every parameter inside reentrant checkpoints:
    each backward ends its own round (its gradients all came in nested
    passes) and trains as plain torch. Before: the round stayed open into
    the next micro-step; stage 2 at GA 2 raised a false "received gradients
    twice" there. Stage 1 at GA 2 reduces at the step (no reducer)."""
    for result in job:
        run = result["direct"][f"s{stage}_ga{ga}"]
        assert "error" not in run, f"stage {stage}, rank {result['rank']}: {run['error']}"
        reducer = None if (stage, ga) == (1, 2) else False
        assert run["open_after"] == [reducer] * (worker.DIRECT_STEPS * ga), run["open_after"]
        want = result["direct_reference"][str(ga)]
        diff = max(abs(a - b) for n in want
                   for a, b in zip(run["params"][n], want[n], strict=True))
        assert diff <= TOLERANCE, f"stage {stage}, rank {result['rank']}: {diff:.3g}"
