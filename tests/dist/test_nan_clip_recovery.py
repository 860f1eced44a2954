"""One NaN gradient at ZeRO 1-3 with ``gradient_clipping`` (fp32 and bf16,
2 ranks, a padded partition; workers/nan_clip_recovery.py: one dsrun job)
skips that step only, as in DeepSpeed 0.19.8: the next steps are applied
with a finite norm, and the parameters end where a run without the NaN step
ends (a skipped step leaves the parameters and Adam's state alone).

Before: the step clipped before it checked the norm, so the NaN coefficient
turned the partition's zero padding NaN; the padding is never written again,
so stages 1-2 skipped every later step (norm inf) and training stopped. The
skip warning also said "another rank holds it" when rank 0's partition held
the NaN gradient.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.conftest import ROOT, rank_results
from tests.dist.workers import nan_clip_recovery as worker

pytestmark = pytest.mark.dist

WORKER = ROOT / "tests" / "dist" / "workers" / "nan_clip_recovery.py"


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out = tmp_path_factory.mktemp("nan_clip_recovery")
    return rank_results(WORKER, out, 2, timeout=300, env={"OMP_NUM_THREADS": "1"})


@pytest.mark.parametrize("name", list(worker.RUNS))
def test_one_nan_step_is_skipped_and_training_goes_on(job: list[dict[str, Any]],
                                                      name: str) -> None:
    for result in job:
        run, clean = result["runs"][name]["nan"], result["runs"][name]["clean"]
        where = f"{name}, rank {result['rank']}"
        steps = run["steps"]
        assert [s["applied"] for s in steps] == [i != worker.NAN_AT for i in range(len(steps))], \
            (where, steps)
        assert [s["skipped"] for s in steps][-1] == 1, (where, steps)
        assert steps[worker.NAN_AT]["norm"] == float("inf") and \
            not steps[worker.NAN_AT]["moved"], (where, steps)
        later = steps[worker.NAN_AT + 1:]
        assert all(s["moved"] and s["norm"] < float("inf") for s in later), (where, steps)
        assert run["params"] == clean["params"], where


@pytest.mark.parametrize("fp16", ("", "_fp16"))
def test_the_skip_warning_names_rank_0s_bad_parameter(job: list[dict[str, Any]],
                                                      fp16: str) -> None:
    """Linear(6, 1) at 2 ranks: rank 0's partition is 4 of the weight's 6
    elements; the bias is in rank 1's (fp16: the overflow line)."""
    warnings = job[0]["warnings"]
    weight, bias = warnings["weight" + fp16], warnings["bias" + fp16]
    assert len(weight) == 1 and "first non-finite gradient: weight)" in weight[0], warnings
    assert len(bias) == 1 and "another rank holds it" in bias[0], warnings


@pytest.mark.parametrize("stage", (1, 2, 3))
def test_a_skipped_round_is_zeroed_at_the_next_clear(job: list[dict[str, Any]],
                                                     stage: int) -> None:
    """Between steps the accumulators are kept unzeroed (the next round
    copies over every real element, not the padding); after a skipped step
    (``discard_round``) they are zeroed, so nothing non-finite stays."""
    for result in job:
        assert result["kept"][f"s{stage}_True"] is False, result["kept"]
        assert result["kept"][f"s{stage}_False"] is True, result["kept"]  # the usual reuse


@pytest.mark.parametrize("stage", (1, 2, 3))
def test_a_nan_norm_does_not_clip(solo: None, stage: int) -> None:
    """Clipping by a NaN norm leaves the partition gradients alone (a NaN
    coefficient would poison the padding); an inf norm clips to zero, as
    DeepSpeed's coefficient 0."""
    import torch

    engine = worker.build(stage, False, 1)
    try:
        opt = engine.optimizer
        worker.one_step_backward(engine)
        opt.reduce_gradients()
        before = [m.grad.clone() for m in opt.masters]
        opt.clip_to(torch.tensor(float("nan")), 1.0)
        assert all(torch.equal(a, m.grad) for a, m in zip(before, opt.masters))
        opt.clip_to(torch.tensor(float("inf")), 1.0)
        assert all(not bool(m.grad.any()) for m in opt.masters)
    finally:
        engine.destroy()
