"""``dsrun.utils`` with 2 gloo ranks: one job for the module
(``workers/utils_cases.py``), then the checkpoint it saved at ZeRO stage 3
is consolidated here with the ``zero_to_fp32`` API and command.

* zero_to_fp32: the consolidated state dict equals the gathered parameters
  (tied name included); the file loads into a plain model with
  ``strict=True``; a tiny ``max_shard_size`` gives Hugging Face's shard
  files and index; safetensors; ``--exclude_frozen_parameters``; lazy mode;
  ``python -m dsrun.utils.zero_to_fp32`` and its errors.
* safe_get/set at stages 1 (unreduced gradients under accumulation), 2 and
  3 against a plain model trained on the same global batches, and stage 3's
  local shards against the full values.
* log_dist's rank filter.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.conftest import ROOT, dsrun_argv
from tests.dist.test_engine_dist import _run
from tests.dist.workers.utils_cases import Net

pytestmark = pytest.mark.dist

WORKER = ROOT / "tests" / "dist" / "workers" / "utils_cases.py"
# largest difference relative to the largest reference value: fused (engine)
# vs single-tensor (reference) AdamW and sums in another order round apart
# (measured below 1e-6); a wrong slice or a missing mean is off by > 1e-2
TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("utils_out")
    ckpt = tmp_path_factory.mktemp("utils_ckpt")
    argv = dsrun_argv("--cpu", "--num_gpus", "2", str(WORKER), "--out", str(out),
                      "--ckpt", str(ckpt))
    results = _run(argv, out)
    assert [r["world_size"] for r in results] == [2, 2]
    return {"ranks": results, "out": out, "ckpt": ckpt}


def facts(job: dict[str, Any], name: str) -> list[dict[str, Any]]:
    found = [r[name] for r in job["ranks"]]
    for rank, fact in enumerate(found):
        assert fact["ok"], f"rank {rank}:\n{fact['error']}"
    return found


@pytest.fixture(scope="module")
def saved(job: dict[str, Any]) -> Path:
    facts(job, "save_stage3")
    return job["ckpt"]


def full(job: dict[str, Any]) -> dict[str, torch.Tensor]:
    return torch.load(job["out"] / "full.pt")


# ------------------------------------------------------------ zero_to_fp32


def test_state_dict_from_a_two_rank_stage3_checkpoint(job: dict[str, Any], saved: Path) -> None:
    from dsrun.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    state = get_fp32_state_dict_from_zero_checkpoint(str(saved))
    want = full(job)
    assert list(state) == list(Net().state_dict()) == list(want)
    for key in want:
        assert state[key].dtype == want[key].dtype and torch.equal(state[key], want[key]), key
    assert state["back.weight"] is state["inp.weight"]  # tied: one tensor
    same = get_fp32_state_dict_from_zero_checkpoint(str(saved), tag="global_step2")
    assert all(torch.equal(same[k], state[k]) for k in state)


def test_converted_file_loads_strictly_into_a_plain_model(job: dict[str, Any], saved: Path,
                                                           tmp_path: Path) -> None:
    from dsrun.utils.zero_to_fp32 import convert_zero_checkpoint_to_fp32_state_dict

    convert_zero_checkpoint_to_fp32_state_dict(str(saved), str(tmp_path / "hf"))
    assert sorted(p.name for p in (tmp_path / "hf").iterdir()) == ["pytorch_model.bin"]
    model = Net()
    model.load_state_dict(torch.load(tmp_path / "hf" / "pytorch_model.bin"), strict=True)
    want = full(job)
    for key, value in model.state_dict().items():
        assert torch.equal(value, want[key]), key
    assert model.back.weight is model.inp.weight


def test_tiny_max_shard_size_writes_shards_and_the_index(job: dict[str, Any], saved: Path,
                                                         tmp_path: Path) -> None:
    from dsrun.utils.zero_to_fp32 import convert_zero_checkpoint_to_fp32_state_dict

    done = convert_zero_checkpoint_to_fp32_state_dict(str(saved), str(tmp_path), "300B")
    index = json.loads((tmp_path / "pytorch_model.bin.index.json").read_text())
    files = sorted(p.name for p in tmp_path.iterdir() if p.suffix == ".bin")
    count = len(files)
    assert count > 2 and files == [f"pytorch_model-{i:05d}-of-{count:05d}.bin"
                                   for i in range(1, count + 1)]
    assert [Path(f).name for f in done.files] == files
    want = full(job)
    assert set(index["weight_map"]) == set(want) and set(index["weight_map"].values()) == \
        set(files)
    stored = {k: v for k, v in want.items() if k != "back.weight"}  # tied: stored once
    assert index["metadata"]["total_size"] == sum(v.numel() * v.element_size()
                                                  for v in stored.values())
    merged: dict[str, torch.Tensor] = {}
    for name in files:
        part = torch.load(tmp_path / name)
        assert all(index["weight_map"][k] == name for k in part)
        size = sum(v.numel() * v.element_size() for k, v in part.items() if k != "back.weight")
        assert size <= 300 or len(part) == 1 + ("inp.weight" in part)  # one oversized tensor
        merged.update(part)
    Net().load_state_dict(merged, strict=True)
    assert all(torch.equal(merged[k], want[k]) for k in want)
    assert index["weight_map"]["back.weight"] == index["weight_map"]["inp.weight"]


def test_safetensors_output(job: dict[str, Any], saved: Path, tmp_path: Path) -> None:
    safetensors = pytest.importorskip("safetensors.torch",
                                      reason="the safetensors package reads the output")
    from dsrun.utils.zero_to_fp32 import convert_zero_checkpoint_to_fp32_state_dict

    convert_zero_checkpoint_to_fp32_state_dict(str(saved), str(tmp_path), safe_serialization=True)
    state = safetensors.load_file(str(tmp_path / "model.safetensors"))
    want = full(job)
    assert set(state) == set(want)
    assert all(torch.equal(state[k], want[k]) for k in want)
    convert_zero_checkpoint_to_fp32_state_dict(str(saved), str(tmp_path / "s"), "500B",
                                               safe_serialization=True)
    index = json.loads((tmp_path / "s" / "model.safetensors.index.json").read_text())
    merged: dict[str, torch.Tensor] = {}
    for name in sorted(set(index["weight_map"].values())):
        assert name.startswith("model-") and name.endswith(".safetensors")
        merged.update(safetensors.load_file(str(tmp_path / "s" / name)))
    assert set(merged) == set(want) and all(torch.equal(merged[k], want[k]) for k in want)


def test_exclude_frozen_and_lazy_mode(job: dict[str, Any], saved: Path) -> None:
    from dsrun.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint, to_torch_tensor

    lazy = get_fp32_state_dict_from_zero_checkpoint(str(saved), exclude_frozen_parameters=True,
                                                    lazy_mode=True)
    want = full(job)
    assert list(lazy) == [k for k in want if k != "frozen"]
    assert lazy["back.weight"] is lazy["inp.weight"]
    assert lazy["mid.weight"].shape == (10, 10) and lazy["mid.weight"].dtype == torch.float32
    assert torch.equal(lazy["mid.weight"].contiguous(), want["mid.weight"])
    tensors = to_torch_tensor(lazy)
    assert all(torch.equal(tensors[k], want[k]) for k in tensors)
    assert tensors["back.weight"] is tensors["inp.weight"]


def run_module(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dsrun.utils.zero_to_fp32", *args],
                          capture_output=True, text=True, timeout=120, cwd=str(ROOT))


def test_the_command(job: dict[str, Any], saved: Path, tmp_path: Path) -> None:
    res = run_module(str(saved), str(tmp_path / "a"), "-t", "global_step2",
                     "--exclude_frozen_parameters")
    assert res.returncode == 0, res.stderr
    assert "pytorch_model.bin" in res.stdout and not res.stderr.strip()
    state = torch.load(tmp_path / "a" / "pytorch_model.bin")
    assert "frozen" not in state and torch.equal(state["out.bias"], full(job)["out.bias"])
    res = run_module(str(saved), str(tmp_path / "b"), "--max_shard_size", "1KB")
    assert res.returncode == 0, res.stderr
    assert (tmp_path / "b" / "pytorch_model.bin.index.json").exists()


def test_the_command_names_bad_input(saved: Path, tmp_path: Path) -> None:
    res = run_module(str(saved), str(tmp_path / "x"), "-t", "nope")
    assert res.returncode == 1 and "nope" in res.stderr and "Traceback" not in res.stderr
    res = run_module(str(tmp_path / "missing"), str(tmp_path / "x"))
    assert res.returncode == 1 and "does not exist" in res.stderr
    res = run_module(str(saved), str(tmp_path / "x"), "--max_shard_size", "lots")
    assert res.returncode == 1 and "max_shard_size" in res.stderr


# ----------------------------------------------------------- safe_get/set


@pytest.mark.parametrize("stage", (1, 2, 3))
def test_full_values_gradients_and_state_match_a_plain_model(job: dict[str, Any],
                                                             stage: int) -> None:
    for fact in facts(job, f"access_s{stage}"):
        assert not fact["problems"], fact["problems"]  # None exactly where the reference has none
        kinds = {"grad", "stepped_value", "stepped_vs_gathered", "stepped_exp_avg",
                 "stepped_exp_avg_sq", "set_grad", "after_set_value", "after_set_exp_avg"}
        if stage == 1:
            kinds.add("partial_grad")
        assert kinds <= set(fact["max"]), fact["max"]
        assert all(v <= TOLERANCE for v in fact["max"].values()), fact["max"]
        assert fact["max"]["stepped_vs_gathered"] == 0.0  # the master is the parameter (fp32)
        assert fact["state_before_step_is_none"]
        assert fact["grad_after_step_is_none"] == (stage != 1)  # stage 1 keeps zeroed buffers
        assert fact["set_value_exact"] and fact["set_model_exact"]


def test_stage3_local_shards_are_parts_of_the_full_values(job: dict[str, Any]) -> None:
    for fact in facts(job, "access_s3"):
        for key in ("local_value_mid.weight", "local_value_out.bias",
                    "local_exp_avg_mid.weight", "local_exp_avg_out.bias",
                    "local_set_full", "local_set_gathered"):
            assert fact[key], key


def test_log_dist_logs_on_the_ranks_asked_for(job: dict[str, Any]) -> None:
    rank0, rank1 = (f["messages"] for f in facts(job, "log_dist"))
    assert rank0 == ["[Rank 0] all", "[Rank 0] zero", "[Rank 0] both"]
    assert rank1 == ["[Rank 1] all", "[Rank 1] one", "[Rank 1] both", "[Rank 1] warn"]
