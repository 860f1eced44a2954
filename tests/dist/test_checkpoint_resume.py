"""Resume equivalence and multi-rank checkpoint behaviour on 2 gloo ranks.

Two jobs for the whole module (``workers/checkpoint_cases.py``): the
*straight* job trains N=3 steps at each ZeRO stage 0-3 (gradient
accumulation 2, a WarmupDecayLR schedule, dropout, a frozen parameter and a
buffer, batches from the engine's dataloader), saves, and trains M=4 more;
the *resume* job - new processes - builds each engine from another seed,
loads, and trains M steps. Losses, learning rates, batches and final
parameters must be bitwise equal: fp32 on gloo with 2 ranks is
deterministic, so anything the checkpoint fails to restore (optimizer state,
scheduler, RNG for dropout, data position, counters) shows as a difference.
The straight job also runs the cases that need 2 ranks: tag disagreement,
async vs sync saves, consolidation, the 16-bit model, and a save called on
rank 0 only.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import pytest
import torch

import dsrun
from tests.conftest import ROOT, dsrun_argv
from tests.dist.test_engine_dist import _run

pytestmark = pytest.mark.dist

WORKER = ROOT / "tests" / "dist" / "workers" / "checkpoint_cases.py"
STAGES = (0, 1, 2, 3)


def job(ranks: int, *args: str) -> list[str]:
    """The argv of a CPU job of ``ranks`` gloo ranks (one place for launcher flags)."""
    return dsrun_argv("--cpu", "--num_gpus", str(ranks), str(WORKER), *args)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    ckpt = tmp_path_factory.mktemp("ckpt")
    straight_out = tmp_path_factory.mktemp("straight")
    resume_out = tmp_path_factory.mktemp("resume")
    stages = ",".join(map(str, STAGES))
    straight = _run(job(2, "--mode", "straight", "--out", str(straight_out), "--ckpt", str(ckpt),
                        "--stages", stages, "--extras"), straight_out)
    resume = _run(job(2, "--mode", "resume", "--out", str(resume_out), "--ckpt", str(ckpt),
                      "--stages", stages), resume_out)
    return {"straight": straight, "resume": resume, "ckpt": ckpt,
            "straight_out": straight_out, "resume_out": resume_out}


def extra(runs: dict[str, Any], name: str) -> list[dict[str, Any]]:
    facts = [r[name] for r in runs["straight"]]
    for rank, fact in enumerate(facts):
        assert fact["ok"], f"rank {rank}:\n{fact['error']}"
    return facts


@pytest.mark.parametrize("stage", STAGES)
def test_resume_is_bitwise_equal_to_straight_run(runs: dict[str, Any], stage: int) -> None:
    for rank in (0, 1):
        straight = runs["straight"][rank][f"stage{stage}"]
        resumed = runs["resume"][rank][f"stage{stage}"]
        assert resumed["losses"] == straight["losses"]  # float.hex(): bitwise
        assert resumed["lrs"] == straight["lrs"]
        assert resumed["global_steps"] == straight["global_steps"] == 7
        assert resumed["global_samples"] == straight["global_samples"] == 7 * 16
        a = torch.load(runs["straight_out"] / f"params_s{stage}_r{rank}.pt")
        b = torch.load(runs["resume_out"] / f"params_s{stage}_r{rank}.pt")
        assert a.keys() == b.keys()
        for key in a:
            assert torch.equal(a[key], b[key]), (stage, rank, key)


@pytest.mark.parametrize("stage", STAGES)
def test_data_continues_at_the_next_batch(runs: dict[str, Any], stage: int) -> None:
    """The saved position is mid-epoch (6 of 8 micro-batches per rank); the
    resumed run gets the 7th and 8th, then the next epoch's, in order."""
    for rank in (0, 1):
        straight = runs["straight"][rank][f"stage{stage}"]["batches"]
        resumed = runs["resume"][rank][f"stage{stage}"]["batches"]
        assert resumed == straight and len(resumed) == 8


def test_client_state_round_trips_and_path_is_the_tag_directory(runs: dict[str, Any]) -> None:
    for stage in STAGES:
        resumed = runs["resume"][0][f"stage{stage}"]
        client = dict(resumed["client_state"])
        assert client.pop("global_samples") == resumed["samples_at_load"]  # DeepSpeed's key
        # DeepSpeed's other keys, as its load_checkpoint returns them for a 2-rank save
        config = client.pop("ds_config")
        assert config["zero_optimization"]["stage"] == stage and config["train_batch_size"] == 16
        assert client.pop("ds_version") == dsrun.__version__
        assert client.pop("buffer_names") == ["scale"]
        shapes = [[["inp.weight", [24, 12]], ["inp.bias", [24]], ["mid.weight", [24, 24]],
                   ["mid.bias", [24]], ["out.weight", [5, 24]], ["out.bias", [5]]]]
        assert client.pop("param_shapes") == (None if stage == 0 else
                                              [dict(group) for group in shapes])
        assert client.pop("frozen_param_shapes") == ({"offset": [24]} if stage >= 2 else None)
        assert client.pop("shared_params") == (None if stage == 0 else {})
        assert client.pop("checkpoint_parallel_dimensions") == {"pp_degree": 1, "tp_degree": 1}
        assert client == {"stage": stage, "note": [1, 2]}
        assert resumed["path"] == str(runs["ckpt"] / f"stage{stage}" / "global_step3")


def test_each_rank_wrote_its_own_slices(runs: dict[str, Any]) -> None:
    tag = runs["ckpt"] / "stage3" / "global_step3"
    manifest = json.loads((tag / "manifest.json").read_text())
    assert manifest["world_size"] == 2 and manifest["meta"]["zero_stage"] == 3
    ranks = {c[0] for t in manifest["tensors"].values() for item in t["items"].values()
             for c in item["chunks"]}
    assert ranks == {0, 1}
    assert (tag / "rank_00000.bin").stat().st_size > 0 and (tag / "rank_00001.bin").stat().st_size
    assert (runs["ckpt"] / "stage3" / "latest").read_text() == "global_step3"
    assert not any(p.name.endswith(".tmp") for p in (runs["ckpt"] / "stage3").iterdir())


def test_different_tags_on_different_ranks_name_them(runs: dict[str, Any]) -> None:
    for fact in extra(runs, "tag_mismatch"):
        assert "rank 0: 't0'" in fact["error_text"] and "rank 1: 't1'" in fact["error_text"]
    assert not (runs["ckpt"] / "mismatch").exists() or not any(
        (runs["ckpt"] / "mismatch").iterdir())


def test_bad_arguments_on_one_rank_fail_on_every_rank_before_anything_is_written(
        runs: dict[str, Any]) -> None:
    for fact in extra(runs, "refused_arguments"):
        assert fact["client_text"].startswith("saving checkpoint 't' failed on rank 1: ")
        assert "save_checkpoint(client_state=...) must be a dict (a Mapping), got list [1, 2]" \
            in fact["client_text"]
        assert fact["tag_text"].startswith(f"saving checkpoint '{'x' * 250}' failed on ranks "
                                           "0, 1: the tag")
        assert "is 250 bytes long (os.fsencode), more than the 246" in fact["tag_text"]
    assert sorted(p.name for p in (runs["ckpt"] / "refused_arguments").iterdir()) == [
        "latest", "ok", "zero_to_fp32.py", "zero_to_torch.py"]


def test_save_on_one_rank_only_fails_after_the_timeout(runs: dict[str, Any]) -> None:
    rank0, rank1 = extra(runs, "only_rank0")
    assert "called on rank 0 but rank 1 did not call it within 3 s" in rank0["error_text"]
    assert rank1["error_text"] is None
    assert not (runs["ckpt"] / "only0" / "latest").exists()


def test_async_save_equals_a_sync_save_of_the_same_state(runs: dict[str, Any]) -> None:
    extra(runs, "async_vs_sync")
    root = runs["ckpt"] / "async"
    for rank in (0, 1):
        name = f"rank_{rank:05d}.bin"
        assert (root / "sync" / name).read_bytes() == (root / "async" / name).read_bytes()
    sync = json.loads((root / "sync" / "manifest.json").read_text())
    done = json.loads((root / "async" / "manifest.json").read_text())
    assert sync["tensors"] == done["tensors"]
    assert (root / "latest").read_text() == "async"
    assert (root / "first" / "manifest.json").exists()


def test_every_rank_sees_an_async_save_committed_once_it_waited(runs: dict[str, Any]) -> None:
    """load_checkpoint() without a tag right after an asynchronous save, and
    wait_for_checkpoint(), wait for rank 0's commit on every rank."""
    for seen in extra(runs, "async_then_latest"):
        assert seen == {"ok": True, "after_wait": "first", "loaded": "second",
                        "latest_after_wait": "third"}


def test_a_full_disk_on_one_rank_during_an_async_save_fails_fast_naming_the_file(
        runs: dict[str, Any]) -> None:
    """Rank 1's background write hits ENOSPC (checkpoint.timeout is the
    default 600 s): the failure reaches rank 0 through the store, not the
    full directory, so the next save raises it at once on both ranks, its
    file and cause first; TAG.tmp/ is gone and the previous tag intact."""
    rank0, rank1 = extra(runs, "async_disk_full")
    for fact in (rank0, rank1):
        assert fact["error_text"] is not None
        assert fact["error_text"].startswith("no space left on the device writing "), fact
        assert "bad.tmp/rank_00001.bin" in fact["error_text"]
        assert "(the asynchronous save of tag 'bad' failed on rank 1)" in fact["error_text"]
        assert fact["seconds"] < 30, fact
        assert fact["listing"] == ["good", "latest", "zero_to_fp32.py", "zero_to_torch.py"]
        assert fact["latest"] == "good"
    assert rank0["error_text"] == rank1["error_text"]
    manifest = runs["ckpt"] / "async_full" / "good" / "manifest.json"
    assert json.loads(manifest.read_text())["tensors"]


def test_a_failed_async_commit_on_rank_0_raises_on_every_rank(runs: dict[str, Any]) -> None:
    """Rank 0's commit fails after rank 1's write succeeded: the agreement
    that ends the wait carries the error, so wait_for_checkpoint raises it,
    the same, on rank 1 too."""
    rank0, rank1 = extra(runs, "async_commit_fails")
    assert rank0["error_text"] is not None and "injected commit failure" in rank0["error_text"]
    assert rank1["error_text"] == rank0["error_text"]


def test_consolidation_equals_the_full_state_dict(runs: dict[str, Any], tmp_path: Path) -> None:
    from dsrun.runtime.checkpoint.consolidate import to_fp32

    extra(runs, "consolidation")
    out = tmp_path / "full.pt"
    to_fp32(str(runs["ckpt"] / "consolidate"), str(out))
    mine, full = torch.load(out), torch.load(runs["straight_out"] / "consolidate_full.pt")
    assert list(mine) == list(full)
    for key in full:
        assert mine[key].dtype == full[key].dtype and torch.equal(mine[key], full[key]), key


def test_16bit_model_at_stage3_gathers_the_weights(runs: dict[str, Any]) -> None:
    assert all(fact["saved16"] for fact in extra(runs, "consolidation"))
    saved = torch.load(runs["ckpt"] / "model16" / "model.bin")
    full = torch.load(runs["straight_out"] / "consolidate_full.pt")
    assert list(saved) == list(full)  # fp32 training: the module's own dtype, as DeepSpeed
    assert all(torch.equal(saved[k], full[k]) for k in full)
    assert not [p for p in os.listdir(runs["ckpt"] / "model16") if p != "model.bin"]


def test_zero3_consolidated_16bit_state_dict_is_on_rank_0_only(runs: dict[str, Any]) -> None:
    assert [fact["consolidated"] for fact in extra(runs, "consolidation")] == [True, False]
    state = torch.load(runs["straight_out"] / "consolidated16.pt")
    full = torch.load(runs["straight_out"] / "consolidate_full.pt")
    assert list(state) == list(full) and all(torch.equal(state[k], full[k]) for k in full)


def test_a_scalar_parameters_moments_load_at_every_stage(runs: dict[str, Any]) -> None:
    for fact in extra(runs, "scalar_param"):
        expected = [float.fromhex(v) for v in fact["expected"]]
        for stage, losses in fact["loaded"].items():
            got = [float.fromhex(v) for v in losses]
            assert got == pytest.approx(expected, rel=1e-5), stage


def test_parameters_frozen_when_saved_load_and_train_on_every_rank(runs: dict[str, Any]) -> None:
    for fact in extra(runs, "unfreeze"):
        for stage in ("2", "3"):
            assert len(fact[stage]) == 2 and all(math.isfinite(v) for v in fact[stage])


def test_a_state_refused_on_one_rank_fails_on_every_rank_and_changes_nothing(
        runs: dict[str, Any]) -> None:
    rank0, rank1 = extra(runs, "refused_on_one_rank")
    assert rank0["error_text"] == rank1["error_text"]
    assert "failed on rank 1: KeyError" in rank0["error_text"]
    assert rank0["unchanged"] and rank1["unchanged"]
