"""``deepspeed.runtime.utils.clip_grad_norm_`` with an mpu on 2 gloo ranks
(``workers/clip_mpu.py``): the norm over the model-parallel group equals
torch's over the whole model, for the 2-, 1- and inf-norms, and the
gradients are clipped as torch clips them."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import ROOT, rank_results

pytestmark = pytest.mark.dist


def test_clip_grad_norm_reduces_over_the_model_parallel_group(tmp_path: Path) -> None:
    results = rank_results(ROOT / "tests" / "dist" / "workers" / "clip_mpu.py", tmp_path,
                           world=2, timeout=120)
    for rank, cases in enumerate(results):
        for norm_type, fact in cases.items():
            assert fact["norm"] == pytest.approx(fact["expected"], rel=1e-6), (rank, norm_type)
            assert fact["grads_match"], (rank, norm_type)
