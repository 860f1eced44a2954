"""The engine on real gloo ranks: one job runs every case, these tests read its facts.

``two_ranks`` starts ``dsrun --num_gpus 2 workers/engine_cases.py`` once for
the module (importing torch costs seconds per process); ``one_rank`` runs the
same worker under plain ``python`` (world size 1, HashStore, no launcher).

Parity with DDP is asserted **bitwise** (``torch.equal``, max abs diff 0.0),
not within a tolerance, because the arithmetic is the same operation for
operation: rank 0's weights broadcast to both; each rank computes its
gradients with the same kernels; both multiply each gradient by 1/2 before
the sum (DDP's fused ``mul_out``, an exact power-of-two scaling); a
two-rank all-reduce computes ``a + b``, which IEEE addition makes equal to
``b + a`` whatever the bucket layout (the engine's buckets differ from DDP's
on purpose in the accumulation case); accumulation divides each micro loss
by 4 (exact) and sums into ``.grad`` in the same order; clipping is
``clip_grad_norm_`` over the parameters in the same order; the optimizer is
the same AdamW and the LR schedule the same WarmupDecayLR stepped once per
optimizer step. With 3+ ranks a ring all-reduce's summation order depends on
the element's position in its bucket, so there the comparison would need a
tolerance (1e-6); this suite runs 2 ranks.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import ROOT, dsrun_argv

pytestmark = pytest.mark.dist

WORKER = ROOT / "tests" / "dist" / "workers" / "engine_cases.py"
JOB_TIMEOUT_S = 240
LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                 "MASTER_PORT", "DSRUN_CONFIG", "DSRUN_JOB_ID")


def _run(argv: list[str], out: Path) -> list[dict[str, Any]]:
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS}
    env["DSRUN_ACCELERATOR"] = "cpu"  # the cases are CPU ones, under plain python too
    res = subprocess.run(argv, capture_output=True, text=True, timeout=JOB_TIMEOUT_S, env=env,
                         cwd=str(ROOT))
    files = sorted(out.glob("rank*.json"))
    assert res.returncode == 0 and files, f"job failed ({res.returncode}):\n{res.stderr[-4000:]}"
    return [json.loads(f.read_text()) for f in files]


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out = tmp_path_factory.mktemp("two_ranks")
    results = _run(dsrun_argv("--cpu", "--num_gpus", "2", str(WORKER), "--out", str(out)), out)
    assert [r["world_size"] for r in results] == [2, 2]
    return results


def case(results: list[dict[str, Any]], name: str) -> list[dict[str, Any]]:
    """The case's facts from every rank, failing with the rank's traceback."""
    facts = [r[name] for r in results]
    for rank, fact in enumerate(facts):
        assert fact["ok"], f"rank {rank}:\n{fact['error']}"
    return facts


def assert_parity(fact: dict[str, Any]) -> None:
    assert fact["initial_agree"]  # different seeds per rank, broadcast from rank 0
    assert fact["losses"] == fact["ref_losses"]
    assert fact["params_equal"] and fact["max_abs_diff"] == 0.0
    assert fact["lrs"] == fact["ref_lrs"]
    assert fact["ranks_agree"] and fact["global_steps"] == 20


def test_parity_with_ddp_no_accumulation(two_ranks: list[dict[str, Any]]) -> None:
    for fact in case(two_ranks, "parity_gas1"):
        assert_parity(fact)
        assert fact["global_samples"] == 20 * 8 and fact["buckets"] == 1


def test_parity_with_ddp_accumulation_clipping_schedule(two_ranks: list[dict[str, Any]]) -> None:
    for fact in case(two_ranks, "parity_gas4_clip_schedule"):
        assert_parity(fact)
        assert fact["clipped_steps"] > 0  # clipping was active, not a no-op
        assert fact["lrs"][0] < fact["lrs"][5] and fact["lrs"][-1] < fact["lrs"][5]  # warm, decay
        assert fact["buckets"] > 1  # several buckets, launched in order while backward ran
        assert fact["global_samples"] == 20 * 32


@pytest.mark.parametrize("name", ["zero1_gas1", "zero1_gas4_clip_schedule",
                                  "zero2_gas1_client", "zero2_gas4_clip_schedule",
                                  "zero3_gas1", "zero3_gas4_clip_schedule_client",
                                  "zero2_gas4_clip_offload", "zero3_gas4_clip_offload"])
def test_zero_stages_match_ddp(two_ranks: list[dict[str, Any]], name: str) -> None:
    """ZeRO 1/2/3 through initialize(): equal to DDP within 1e-6 (bitwise is not
    promised: the clip norm is summed from partition norms, and stage 2 adds
    per-micro-step means where DDP takes the mean of the sum)."""
    for fact in case(two_ranks, name):
        assert fact["initial_agree"] and fact["ranks_agree"]
        assert fact["max_abs_diff"] <= 1e-6
        assert max(abs(a - b) for a, b in zip(fact["losses"], fact["ref_losses"])) <= 1e-5
        assert fact["lrs"] == fact["ref_lrs"] and fact["global_steps"] == 20
        assert fact["buckets"] == 0  # no stage-0 all-reduce hooks under ZeRO
        if "clip" in name:
            assert fact["clipped_steps"] > 0


def test_zero3_model_built_under_init_is_never_whole(two_ranks: list[dict[str, Any]]) -> None:
    for fact in case(two_ranks, "zero3_init"):
        assert fact["held_after_init"] <= fact["shard_max"]
        assert max(fact["held"]) <= fact["shard_max"]  # after every step: shards only
        assert fact["shapes"] == fact["logical_shapes"]  # shape reports the logical one
        assert fact["losses"][-1] < fact["losses"][0] and fact["ranks_agree"]


def test_fp16_overflow_skips_halves_and_continues(two_ranks: list[dict[str, Any]]) -> None:
    injected = {3, 7, 8}  # rank 0 only: the all-reduce carries the inf to rank 1
    for rank, fact in enumerate(case(two_ranks, "fp16_overflow")):
        assert fact["dtype"] == "torch.float16"
        assert [i for i, s in enumerate(fact["skipped"]) if s] == sorted(injected)
        assert fact["unchanged"] == fact["skipped"]  # skipped steps leave the weights alone
        assert fact["skipped_steps"] == 3 and fact["global_steps"] == 14
        expected, scale = [], 4096.0
        for step in range(14):
            scale = scale / 2 if step in injected else scale  # hysteresis 1: halve every time
            expected.append(scale)
        assert fact["scale"] == expected
        losses = fact["loss"]
        assert sum(losses[-3:]) < sum(losses[:3])  # training went on
        assert fact["ranks_agree"]
        lines = fact["overflow_lines"]
        if rank == 0:  # three overflows, one rate-limited line naming the parameter
            assert len(lines) == 1 and "2.weight" in lines[0] and "4096 -> 2048" in lines[0]
        else:
            assert lines == []


def test_bf16_autocast_keeps_fp32_master_weights(two_ranks: list[dict[str, Any]]) -> None:
    for fact in case(two_ranks, "bf16_autocast"):
        assert fact["out_dtype"] == "torch.bfloat16" and fact["param_dtype"] == "torch.float32"
        assert sum(fact["losses"][-3:]) < sum(fact["losses"][:3]) and fact["ranks_agree"]


def test_unused_parameter_and_no_sync(two_ranks: list[dict[str, Any]]) -> None:
    for fact in case(two_ranks, "unused_and_no_sync"):
        assert fact == {"ok": True, "unused_grad_zero": True, "averaged": True,
                        "unused_unchanged": True}


def test_backward_allreduce_off_then_allreduce_gradients(two_ranks: list[dict[str, Any]]
                                                          ) -> None:
    """DeepSpeed's ``enable_backward_allreduce = False`` at stage 0: local
    gradients after backward, averaged by ``allreduce_gradients()``
    bitwise as the hooks average them (and as all_reduce / 2)."""
    for fact in case(two_ranks, "no_backward_allreduce"):
        assert fact["flag"] is False
        assert fact["local"] == [True] * 3 and fact["ranks_differ_before"] == [True] * 3
        assert fact["as_hooks"] == [True] * 3 and fact["as_all_reduce"] == [True] * 3
        assert fact["params_equal"] and fact["ranks_agree"]


@pytest.mark.parametrize("name", ["branch_in_earlier_micro_steps",
                                  "branch_in_earlier_micro_steps_zero2"])
def test_a_gradient_from_an_earlier_micro_step_is_reduced(two_ranks: list[dict[str, Any]],
                                                          name: str) -> None:
    """Branch ``a`` runs only in a micro-step that does not synchronise; the
    optimizer must see its gradient averaged over the ranks (stage 0 once
    replaced it by zeros)."""
    for fact in case(two_ranks, name):
        assert fact["accumulation"] <= 1e-5 and fact.get("no_sync", 0.0) <= 1e-5, fact
        if name.endswith("zero2"):  # it reduces during every backward: no_sync() is refused
            assert fact["no_sync_refused"] is True, fact
        else:
            assert "no_sync" in fact, fact


def test_point_to_point_exchange_with_the_comms_logger(two_ranks: list[dict[str, Any]]
                                                        ) -> None:
    """isend before irecv on both ranks completes with the logger on (it
    waited inside isend and deadlocked); DeepSpeed's P2POp takes
    deepspeed.comm's isend/irecv; the operations are logged."""
    for rank, fact in enumerate(case(two_ranks, "logged_exchange")):
        peer = 1 - rank
        assert fact["received"] == [float(peer)] * 4
        assert fact["batched"] == [2.0 * peer] * 4
        assert set(fact["logged"]) >= {"isend", "irecv", "batch_isend_irecv"}


def test_comms_logger_files_gathers_under_one_ranks_input(two_ranks: list[dict[str, Any]]
                                                           ) -> None:
    """As DeepSpeed: all_gather, all_gather_into_tensor and allgather_fn of
    1 KiB per rank are filed under 1024 bytes, not the 2 KiB gathered; the
    algbw counts the 2 KiB result. allgather_fn is filed under
    all_gather_into_tensor, as DeepSpeed's."""
    for fact in case(two_ranks, "logged_gathers"):
        assert fact["gathered"] == [0.0, 1.0]
        assert set(fact["sizes"]) == {"all_gather", "all_gather_into_tensor"}
        for name, by_size in fact["sizes"].items():
            assert list(by_size) == ["1024"], name
            algbw, latency_ms = by_size["1024"]
            assert algbw == pytest.approx(2048 * 8 / (latency_ms / 1e3) / 1e9), name


def test_dataloader_shards_the_dataset(two_ranks: list[dict[str, Any]]) -> None:
    for fact in case(two_ranks, "dataloader"):
        assert fact["sizes"] == [5] * 4 and fact["train_batch"] == 20
        assert fact["disjoint_cover"]


def test_comms_logger_sees_the_engines_collectives(two_ranks: list[dict[str, Any]]) -> None:
    """``"comms_logger"`` in the config: the engine's gradient reduction and
    parameter gathers are logged with their sizes on every rank, the
    straggler analysis covers the same operations, and logging (which runs
    each operation blocking) changes no loss."""
    steps = 3

    def moved(ops: dict[str, dict[str, int]], name: str) -> int:
        return sum(int(size) * count for size, count in ops.get(name, {}).items())

    for fact in case(two_ranks, "comms_logger"):
        for stage in (0, 2, 3):
            logged, unlogged = fact[f"stage{stage}"]["logged"], fact[f"stage{stage}"]["unlogged"]
            assert logged["losses"] == unlogged["losses"]
            assert unlogged["ops"] == {}  # off: nothing recorded
            ops = logged["ops"]
            # gloo: gradients by all-reduce, parameters by broadcast from their owners
            assert moved(ops, "all_reduce") >= steps * fact["param_bytes"], (stage, ops)
            if stage:
                assert moved(ops, "broadcast") >= steps * fact["param_bytes"], (stage, ops)
            assert logged["straggler"] == {name: sorted(sizes) for name, sizes in ops.items()}


def test_flops_profiler_on_rank_zero_at_stage3(two_ranks: list[dict[str, Any]]) -> None:
    from dsrun.profiling.flops_profiler import params_to_string

    rank0, rank1 = case(two_ranks, "flops_profiler")
    for fact in (rank0, rank1):
        assert fact["losses_on"] == fact["losses_off"]  # counting changes nothing computed
        assert fact["held"] < fact["whole"]  # each rank holds a shard...
    assert rank1["report"] is None
    report = rank0["report"]
    assert report is not None and "Profile Summary at step 1:" in report
    params = next(x for x in report.splitlines() if x.startswith("params per rank:"))
    # ...the report the whole
    assert params.split(":")[1].strip() == params_to_string(rank0["whole"])
    assert "world size:" in report and "data parallel size:" in report


def test_world_size_one_under_plain_python(tmp_path: Path) -> None:
    """The same cases at world size 1: initialize() brings up the group itself."""
    (results,) = _run([sys.executable, str(WORKER), "--out", str(tmp_path)], tmp_path)
    assert results["world_size"] == 1
    for name in ("parity_gas1", "parity_gas4_clip_schedule"):
        (fact,) = case([results], name)
        assert_parity(fact)
        assert fact["buckets"] == 0  # nothing to all-reduce
    (fp16,) = case([results], "fp16_overflow")
    assert fp16["skipped_steps"] == 3 and fp16["scale"][-1] == 512.0
    (loader,) = case([results], "dataloader")
    assert loader["sizes"] == [5] * 8 and loader["train_batch"] == 10
    (manual,) = case([results], "no_backward_allreduce")
    assert manual["local"] == manual["as_hooks"] == [True] * 3 and manual["params_equal"]
    (unused,) = case([results], "unused_and_no_sync")
    assert unused["averaged"] and unused["unused_unchanged"]
    (direct,) = case([results], "direct_backward")
    check_direct_backward(direct)
    # no reduction at world size 1: an unused parameter keeps no gradient
    assert unused["unused_grad_zero"] is False



def check_direct_backward(fact: dict[str, Any]) -> None:
    for name in ("stage0_gas1", "stage0_gas2_fp16", "stage1_gas2", "stage2_gas1_fp16",
                 "stage2_gas2", "stage3_gas2_fp16", "stage3_gas1"):
        assert fact[name] is True, name  # bitwise engine.backward's weights
        assert fact[f"{name}_steps"] == 2 and fact[f"{name}_agree"], name
    assert "engine.scale(loss).backward()" in fact["unscaled"]
    assert "engine.scale(loss).backward()" in fact["scale_elsewhere"]
    assert fact["beside_reentrantFalse"] and fact["beside_reentrantTrue"]
    assert fact["gan"]
    assert fact["unscaled_then_trains"]
    assert fact["returned"] == pytest.approx(fact["loss"] / 2)  # DeepSpeed's return value
    assert fact["penalty_undivided"] and fact["penalty_steps"] == 1
    assert fact["rounds"] == [1, 2, 0, 1, 2, 0]


def test_direct_backward_trains_as_engine_backward(two_ranks: list[dict[str, Any]]) -> None:
    for fact in case(two_ranks, "direct_backward"):
        check_direct_backward(fact)


def test_zero_grad_inside_a_round_drops_what_was_accumulated(
        two_ranks: list[dict[str, Any]]) -> None:
    for fact in case(two_ranks, "zero_grad_mid_round"):
        assert {fact[f"stage{s}"] for s in (0, 2, 3)} == {0.0}, fact


def test_destroying_a_superseded_stage3_engine_leaves_the_newer_one_working(
        two_ranks: list[dict[str, Any]]) -> None:
    for fact in case(two_ranks, "older_destroyed_later"):
        assert fact["twice"] == fact["once"], fact


def test_ranks_with_different_configs_are_named(two_ranks: list[dict[str, Any]]) -> None:
    """A per-rank learning rate (a config file that differs between hosts):
    rank 0 names the key; configs that agree cost one all-reduce, no word."""
    facts = case(two_ranks, "configs_differ")
    assert [f["same"] for f in facts] == [[], []]
    assert len(facts[0]["warned"]) == 1 and not facts[1]["warned"], facts
    assert "optimizer.params differ" in facts[0]["warned"][0], facts
