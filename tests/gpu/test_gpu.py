"""The CUDA/NCCL paths on a real GPU: one ``dsrun --num_gpus 1`` job runs
every case of workers/gpu_cases.py; these tests read its facts.

Tolerances (world size 1, 12 AdamW steps of a 4-layer MLP):

* fp32 stage 0: bitwise equal to plain torch (same kernels, same optimizer).
* fp32 stages 1-3: losses and final weights within 1e-5 relative (the
  update runs on flat fp32 masters instead of per-parameter tensors).
* bf16 (autocast over fp32 weights in both): within 2e-2 relative.
* fp16 (fp16 model + fp32 masters + loss scaling) against the fp32
  reference: within 5e-2 relative (fp16 rounding of weights and
  activations).
* offload against the same stage without it: within 1e-5 relative (the
  optimizer step runs on the CPU instead of the GPU).
"""

from __future__ import annotations

import json
import os
import subprocess
from typing import Any

import pytest

from tests.conftest import ROOT, dsrun_argv

pytestmark = pytest.mark.gpu

WORKER = ROOT / "tests" / "gpu" / "workers" / "gpu_cases.py"
LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                 "MASTER_PORT", "DSRUN_CONFIG", "DSRUN_JOB_ID", "CUDA_VISIBLE_DEVICES")
TOLERANCE = {"fp32": 1e-5, "bf16": 2e-2, "fp16": 5e-2}


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("gpu")
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS}
    res = subprocess.run(dsrun_argv("--num_gpus", "1", str(WORKER), "--out", str(out)),
                         capture_output=True, text=True, timeout=600, env=env, cwd=str(ROOT))
    print(res.stdout[-6000:])
    assert res.returncode == 0, f"GPU job failed ({res.returncode}):\n{res.stderr[-6000:]}"
    return json.loads((out / "results.json").read_text())


def case(results: dict[str, Any], name: str) -> dict[str, Any]:
    facts = results[name]
    assert facts["ok"], facts.get("error")
    return facts


def rel(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b))


def test_nccl_group_on_the_gpu(results):
    facts = case(results, "nccl_group")
    assert facts["backend"] == "nccl" and facts["world_size"] == 1
    assert facts["current_device"] == 0 and facts["cuda_visible_devices"] is not None


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_stage_matches_plain_torch(results, stage, precision):
    facts = case(results, f"parity_s{stage}_{precision}")
    assert facts["device"] == "cuda:0"
    assert facts["skipped"] == 0
    tol = TOLERANCE[precision]
    if precision == "fp32" and stage == 0:
        assert facts["losses"] == facts["ref_losses"] and facts["params_equal"]
    assert rel(facts["losses"], facts["ref_losses"]) <= tol, facts["losses"]
    assert facts["params_rel_diff"] <= tol
    assert facts["losses"][-1] < facts["losses"][0]


def test_fp16_overflow_skips_and_rescales(results):
    facts = case(results, "fp16_overflow")
    assert facts["model_dtype"] == "torch.float16" and facts["grad_dtypes"] == ["torch.float16"]
    assert facts["skipped"][0] == 1 and facts["unchanged_after_first"]
    scales = facts["scales"]
    assert scales[0] < 2 ** 24  # halved by the overflow
    assert any(b > a for a, b in zip(scales, scales[1:])), scales  # grown after the window
    assert facts["skipped"][-1] < len(scales)  # clean steps were applied


def test_zero_init_partitions_on_the_gpu(results):
    facts = case(results, "zero_init_cuda")
    assert facts["shard_devices"] == ["cuda:0"] and facts["param_devices"] == ["cuda:0"]
    assert facts["losses"][-1] < facts["losses"][0]


@pytest.mark.parametrize("name", ["offload_s2", "offload_s3"])
def test_offload_uses_pinned_host_memory_and_matches(results, name):
    facts = case(results, name)
    assert facts["master_devices"] == ["cpu"] and facts["masters_pinned"]
    assert facts["plain_master_devices"] == ["cuda:0"]
    if name == "offload_s3":
        assert facts["shard_devices"] == ["cpu"] and facts["shards_pinned"]
    assert rel(facts["losses"], facts["plain_losses"]) <= 1e-5
    assert facts["params_rel_diff"] <= 1e-5


def test_stage3_with_offload_peaks_below_stage0(results):
    facts = case(results, "memory")
    peaks = facts["peaks"]
    state = 16 * facts["parameters"]  # fp32 weights, grads, Adam moments
    assert peaks["stage3_offload"] < peaks["stage0"] / 2, facts
    assert peaks["stage0"] >= state, facts


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_world_size_one_step_needs_no_host_sync(results, stage):
    """bf16 at world size 1: no hook, the masters are the parameters' flat
    buffer, and a whole step runs without the host waiting for the GPU."""
    facts = case(results, f"no_host_sync_s{stage}")
    assert facts["error"] is None, facts["error"]
    assert not facts["backward_hooks"]
    assert facts["master_is_param_buffer"]


def test_client_state_comes_back_in_host_memory(results):
    facts = case(results, "client_state_cuda")
    assert facts["client_device"] == "cpu" and facts["client_equal"]
    assert facts["client_step"] == 7 and facts["param_devices"] == ["cuda:0"]
