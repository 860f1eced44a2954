"""Pipeline checkpoints on gloo ranks: resume, other layouts, plain engines.

Four dsrun jobs for the whole module (``workers/pipe_checkpoint_cases.py``,
run in this order):

* *straight* (2 ranks, 2 stages): each case trains N=3 steps from the
  engine's dataloader (LR schedule, clipping, AdamW; "tied-dropout" with
  dropout, "mlp-fp16" with a growing loss scale), saves, trains M=4 more; a
  plain data-parallel engine does the same with the "mlp" pipeline's names;
* *resume* (2 ranks, 2 stages, new processes): each case built from
  another seed loads and trains M steps - losses, learning rates and final
  parameters bitwise equal to the straight run (fp32 on gloo, the same
  layout: optimizer state, scheduler, RNG for dropout and data position all
  show if missing); the plain checkpoint into the pipeline; bad input;
* *wide* (4 ranks, 2 stages x 2 replicas, ZeRO 1) and *narrow* (2 ranks,
  1 stage x 2 replicas, ZeRO 2): the "tied" checkpoint loaded into other
  layouts continues the straight run's loss curve within 1e-5 (the global
  batch is the same samples in every layout), and so does the wide job's
  own checkpoint, saved from ZeRO-1 partitions of 2 replicas, loaded into 1
  stage; the "mlp" pipeline checkpoint loads into a plain engine.

Then, in this process: ``dsrun checkpoint to-fp32`` of a pipeline
checkpoint is the one-stage model's state dict, and ``dsrun checkpoint
info`` describes the pipeline.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

from dsrun.runtime.checkpoint.client_state import RETURNED_KEYS
from tests.conftest import ROOT, dsrun_argv, run_dsrun
from tests.dist.test_engine_dist import _run

pytestmark = pytest.mark.dist

WORKER = ROOT / "tests" / "dist" / "workers" / "pipe_checkpoint_cases.py"
TOLERANCE = 1e-5
CASES = ("tied-dropout", "tied", "mlp", "mlp-fp16")


def _job(name: str, ranks: int, ckpt: Path, out: Path) -> list[dict[str, Any]]:
    argv = dsrun_argv("--cpu", "--num_gpus", str(ranks), str(WORKER), "--job", name,
                      "--out", str(out), "--ckpt", str(ckpt))
    results = _run(argv, out)
    assert [r["world_size"] for r in results] == [ranks] * ranks
    return results


@pytest.fixture(scope="module")
def jobs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    ckpt = tmp_path_factory.mktemp("pipe_ckpt")
    found: dict[str, Any] = {"ckpt": ckpt}
    for name, ranks in (("straight", 2), ("resume", 2), ("wide", 4), ("narrow", 2)):
        out = tmp_path_factory.mktemp(name)
        found[name], found[f"{name}_out"] = _job(name, ranks, ckpt, out), out
    return found


def facts(jobs: dict[str, Any], job: str, name: str) -> list[dict[str, Any]]:
    """The case's facts from every rank of ``job``, failing with a rank's traceback."""
    out = [r[name] for r in jobs[job]]
    for rank, fact in enumerate(out):
        assert fact["ok"], f"{job} rank {rank}:\n{fact['error']}"
    return out


def losses(fact: dict[str, Any]) -> list[float]:
    return [float.fromhex(x) for x in fact["losses"]]


def assert_follows(got: list[float], want: list[float]) -> None:
    assert len(got) == len(want) > 0
    assert max(abs(a - b) for a, b in zip(got, want)) <= TOLERANCE, (got, want)


def saved(out: Path, name: str, ranks: int) -> list[dict[str, torch.Tensor]]:
    return [torch.load(out / f"{name}-rank{r}.pt") for r in range(ranks)]


def merged(states: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The union of the ranks' state dicts; a name on several ranks has one value."""
    out: dict[str, torch.Tensor] = {}
    for state in states:
        for key, value in state.items():
            if key in out:
                assert torch.equal(out[key], value), key
            out[key] = value
    return out


# ------------------------------------------------------------ resume equivalence


@pytest.mark.parametrize("name", CASES)
def test_resume_with_two_stages_is_bitwise_the_straight_run(jobs: dict[str, Any],
                                                            name: str) -> None:
    straight, resumed = facts(jobs, "straight", name), facts(jobs, "resume", name)
    for a, b in zip(straight, resumed):
        assert b["start"] == 3 and a["global_steps"] == b["global_steps"] == 7
        assert b["losses"] == a["losses"] and b["lrs"] == a["lrs"]  # float.hex(): bitwise
        assert b["loss_scale"] == a["loss_scale"]
    if name == "mlp-fp16":
        assert straight[0]["loss_scale"] > 2**8  # it grew before and after the save
    for rank in (0, 1):
        a = torch.load(jobs["straight_out"] / f"{name}-final-rank{rank}.pt")
        b = torch.load(jobs["resume_out"] / f"{name}-resumed-rank{rank}.pt")
        assert a.keys() == b.keys()
        assert all(torch.equal(a[k], b[k]) for k in a), name


def test_client_state_and_path(jobs: dict[str, Any]) -> None:
    for fact in facts(jobs, "resume", "tied"):
        client = dict(fact["client_state"])
        assert client.pop("global_samples") > 0  # DeepSpeed's key
        assert client.pop("checkpoint_parallel_dimensions")["pp_degree"] > 1  # the stages saved
        assert {k: v for k, v in client.items() if k not in RETURNED_KEYS} == {"case": "tied"}
        assert fact["path"] == str(jobs["ckpt"] / "tied" / "global_step3")


# ------------------------------------------------------------ other layouts


def test_two_stages_into_two_stages_by_two_replicas_at_zero1(jobs: dict[str, Any]) -> None:
    want = losses(facts(jobs, "straight", "tied")[0])
    wide = facts(jobs, "wide", "wide")
    assert [(f["stage"], f["replica"]) for f in wide] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for fact in wide:
        assert fact["start"] == 3
        assert_follows(losses(fact), want)


def test_two_stages_into_one_stage_at_zero2(jobs: dict[str, Any]) -> None:
    want = losses(facts(jobs, "straight", "tied")[0])
    for fact in facts(jobs, "narrow", "narrow"):
        assert fact["start"] == 3
        assert_follows(losses(fact), want)


def test_four_rank_zero1_checkpoint_into_one_stage(jobs: dict[str, Any]) -> None:
    """Saved by 2 stages x 2 replicas from ZeRO-1 partitions after step 5."""
    wide = losses(facts(jobs, "wide", "wide")[0])
    for fact in facts(jobs, "narrow", "narrow"):
        assert fact["from_wide"]["start"] == 5
        assert_follows(losses(fact["from_wide"]), wide[2:])


def test_pipeline_checkpoint_into_a_plain_engine(jobs: dict[str, Any]) -> None:
    want = losses(facts(jobs, "straight", "mlp")[0])
    for fact in facts(jobs, "narrow", "pipeline->plain"):
        assert fact["start"] == 3
        assert_follows(losses(fact), want)


def test_plain_checkpoint_into_a_pipeline(jobs: dict[str, Any]) -> None:
    want = losses(facts(jobs, "straight", "plain")[0])
    for fact in facts(jobs, "resume", "plain->pipeline"):
        assert fact["start"] == 3
        assert_follows(losses(fact), want)


def test_tied_weights_stay_tied_after_a_load_into_another_layout(jobs: dict[str, Any]
                                                                 ) -> None:
    """Every rank of the 2 x 2 layout holds the tied embedding: after the
    load all copies are the saved value, after training still one value."""
    key = "tied_modules.embed.weight"
    value = merged(saved(jobs["straight_out"], "tied-saved", 2))[key]
    for stage in ("loaded", "final"):
        copies = [s[key] for s in saved(jobs["wide_out"], f"wide-{stage}", 4)]
        assert len(copies) == 4 and all(torch.equal(c, copies[0]) for c in copies), stage
        if stage == "loaded":
            assert torch.equal(copies[0], value)


# ------------------------------------------------------------ the format


def _chunk_ranks(manifest: dict[str, Any], name: str) -> set[int]:
    return {c[0] for item in manifest["tensors"][name]["items"].values() for c in item["chunks"]}


def test_each_stage_writes_its_own_slices_and_tied_weights_once(jobs: dict[str, Any]) -> None:
    two = json.loads((jobs["ckpt"] / "tied" / "global_step3" / "manifest.json").read_text())
    assert _chunk_ranks(two, "tied_modules.embed.weight") == {0}  # not again by stage 1
    assert _chunk_ranks(two, "3.weight") == {1}
    assert two["meta"]["pipeline"] == {"stages": 2, "replicas": 1, "parts": [0, 2, 5]}
    tag = jobs["ckpt"] / "tied-wide" / "global_step5"
    four = json.loads((tag / "manifest.json").read_text())
    assert four["world_size"] == 4 and four["meta"]["zero_stage"] == 1
    assert four["meta"]["pipeline"]["replicas"] == 2
    stage0 = ("tied_modules.embed.weight", "1.up.weight", "1.down.bias")
    assert set().union(*(_chunk_ranks(four, n) for n in stage0)) <= {0, 1}
    assert set().union(*(_chunk_ranks(four, n) for n in ("2.up.weight", "3.bias"))) <= {2, 3}
    everyone = set().union(*(_chunk_ranks(four, n) for n in four["tensors"]))
    assert everyone == {0, 1, 2, 3}  # the replicas' ZeRO-1 partitions, in parallel
    assert four["tensors"].keys() == two["tensors"].keys()


def test_async_save_equals_the_sync_save(jobs: dict[str, Any]) -> None:
    for rank in (0, 1):
        name = f"global_step3/rank_{rank:05d}.bin"
        sync = (jobs["ckpt"] / "tied" / name).read_bytes()
        assert sync and sync == (jobs["ckpt"] / "tied-async" / name).read_bytes()
    assert (jobs["ckpt"] / "tied-async" / "latest").read_text() == "global_step3"


def test_frozen_parameters_left_out(jobs: dict[str, Any]) -> None:
    for fact in facts(jobs, "resume", "frozen"):
        assert fact["trained_equal"] and fact["frozen_kept"]
        assert "missing from the checkpoint (2): 5.bias, 5.weight (all frozen when saved and " \
            "left out by save_checkpoint(exclude_frozen_parameters=True))" in fact["refused"]
    meta = json.loads((jobs["ckpt"] / "frozen" / "global_step1" / "manifest.json").read_text())
    assert meta["meta"]["excluded_frozen"] == ["5.bias", "5.weight"]
    assert not any(k.startswith("5.") for k in [*meta["tensors"], *meta["meta"]["state_dict_keys"]])


# ------------------------------------------------------------ bad input


def test_a_model_with_other_names_is_refused_and_nothing_changes(jobs: dict[str, Any]) -> None:
    for fact in facts(jobs, "resume", "wrong_model"):
        text = fact["error_text"]
        assert "does not match the model" in text and "tied_modules.embed.weight" in text
        assert "0.linear.weight" in text and fact["unchanged"]


def test_stages_with_different_param_groups_are_refused(jobs: dict[str, Any]) -> None:
    for fact in facts(jobs, "resume", "groups_differ"):
        assert "param group 0 has lr=0.01 on stage 0 and lr=0.02 on stage 1" in \
            fact["error_text"]
    assert not (jobs["ckpt"] / "groups" / "latest").exists()


def test_save_on_one_rank_only_names_the_missing_rank(jobs: dict[str, Any]) -> None:
    rank0, rank1 = facts(jobs, "resume", "only_rank0")
    assert "called on rank 0 but rank 1 did not call it within 3 s" in rank0["error_text"]
    assert rank1["error_text"] is None
    assert not (jobs["ckpt"] / "only0" / "latest").exists()


# ------------------------------------------------------------ tools


def _cases() -> ModuleType:
    if "pipe_checkpoint_cases" not in sys.modules:
        spec = importlib.util.spec_from_file_location("pipe_checkpoint_cases", WORKER)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules["pipe_checkpoint_cases"] = module  # dataclasses look it up there
        spec.loader.exec_module(module)
    return sys.modules["pipe_checkpoint_cases"]


@pytest.fixture(scope="module")
def one_stage() -> Iterator[torch.nn.Module]:
    """The "tied" case as a one-stage PipelineModule, in this process."""
    import torch.distributed as dist

    from dsrun.pipe import PipelineModule

    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        cases = _cases()
        yield PipelineModule(layers=cases.tied_layers(0.0), num_stages=1,
                             loss_fn=cases.token_loss)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("tag, dumps, ranks", [("tied", "tied-saved", 2),
                                               ("tied-wide", "wide-saved", 4)])
def test_to_fp32_is_the_one_stage_models_state_dict(jobs: dict[str, Any], one_stage: Any,
                                                    tmp_path: Path, tag: str, dumps: str,
                                                    ranks: int) -> None:
    out = tmp_path / "model.pt"
    res = run_dsrun("checkpoint", "to-fp32", str(jobs["ckpt"] / tag), str(out))
    assert res.returncode == 0, res.stderr
    state = torch.load(out, weights_only=True)
    order = list(one_stage.state_dict())
    latest = (jobs["ckpt"] / tag / "latest").read_text()
    manifest = json.loads((jobs["ckpt"] / tag / latest / "manifest.json").read_text())
    assert manifest["meta"]["state_dict_keys"] == order  # merged from the stages' keys
    assert list(state) == order  # the same keys, in the same order
    want = merged(saved(jobs["straight_out" if tag == "tied" else "wide_out"], dumps, ranks))
    assert state.keys() == want.keys()
    assert all(torch.equal(state[k], want[k]) for k in want)
    one_stage.load_state_dict(state)  # strict


def test_info_describes_the_pipeline(jobs: dict[str, Any]) -> None:
    res = run_dsrun("checkpoint", "info", str(jobs["ckpt"] / "tied-wide"))
    assert res.returncode == 0, res.stderr
    assert "by 4 rank(s), ZeRO stage 1" in res.stdout
    assert "pipeline: 2 stage(s) x 2 replica(s), layer boundaries [0, 2, 5]" in res.stdout


def test_16bit_model_holds_every_stage(jobs: dict[str, Any]) -> None:
    """save_16bit_model of 2 stages: one file, the one-stage model's keys in
    its order (an nn.Sequential of the same layers), fp16 values."""
    state = torch.load(jobs["ckpt"] / "model16" / "model.bin", weights_only=True)
    assert list(state) == list(_cases().plain_mlp().state_dict())
    want = merged(saved(jobs["straight_out"], "mlp-fp16-saved", 2))
    assert all(state[k].dtype == torch.float16 and torch.equal(state[k], want[k]) for k in want)
    assert sorted(p.name for p in (jobs["ckpt"] / "model16").iterdir()) == ["model.bin"]
