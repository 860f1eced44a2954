"""The GPU checks' entry points refuse, with one clear line, on a host
without CUDA (the CI machine) instead of failing runner by runner."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from tests.conftest import ROOT

pytestmark = pytest.mark.skipif(torch.cuda.is_available(),
                                reason="on a GPU host these would run the GPU checks")


def test_gpu_step_bench_needs_cuda():
    res = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_step.py")],
                         capture_output=True, text=True, timeout=120, cwd=str(ROOT))
    assert res.returncode == 1
    assert res.stderr.strip().splitlines()[-1] == (
        "bench/gpu_step.py needs a CUDA GPU: torch.cuda.is_available() is False here")


def test_gpu_checks_script_needs_cuda(tmp_path):
    # python3 is the interpreter running the tests, as it would be on a GPU host
    env = {**os.environ, "PATH": f"{os.path.dirname(sys.executable)}:{os.environ['PATH']}"}
    res = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_checks.sh"), str(tmp_path)],
                         capture_output=True, text=True, timeout=120, env=env)
    assert res.returncode == 2, res.stdout + res.stderr
    assert "torch.cuda.is_available() is False here: run this on a GPU host" in res.stderr
    assert not (tmp_path / "suite.txt").exists()  # nothing started


def test_gpu_checks_steps_are_checked_before_anything_runs(tmp_path):
    res = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_checks.sh"), str(tmp_path)],
                         capture_output=True, text=True, timeout=60,
                         env={**os.environ, "STEPS": "gpu-tier suit"})
    assert res.returncode == 2, res.stdout + res.stderr
    assert res.stderr.strip() == ("gpu-checks: unknown step suit in STEPS "
                                  "(gpu-tier, suite, bench)")
