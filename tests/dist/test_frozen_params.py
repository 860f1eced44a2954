"""Parameters frozen, unfrozen or left out of the param groups after or at
initialize(), and stage 3 without an optimizer, on 2 gloo ranks through the
engine (workers/frozen_cases.py runs every case in one job), as torch and
DeepSpeed behave:

* stage 3 without an optimizer partitions and gathers for forward (the
  reference/EMA engines of RLHF, evaluation), saves and gathers whole
  weights, and refuses backward and step; stages 1-2 refuse to start;
* a parameter frozen after initialize() is not moved by SGD at any stage
  (stage 3 used to apply its last gradient again every step), and at
  stage 0 has no gradient; stages 1-2 apply nothing on a step with no
  backward;
* at stage 0 a parameter passed in model_parameters but frozen at
  initialize() trains once unfrozen, alike on every rank;
* a trainable parameter in no param group is accepted (stage 3 too) and
  not trained;
* empty param groups are dropped (refused under a client LR scheduler
  built over the client optimizer, which counts its groups);
* checkpoints of these states save and load back, and consolidation with
  exclude_frozen_parameters leaves out what was frozen when saved.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.conftest import ROOT, rank_results

pytestmark = pytest.mark.dist

WORKER = ROOT / "tests" / "dist" / "workers" / "frozen_cases.py"


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out = tmp_path_factory.mktemp("frozen")
    return rank_results(WORKER, out, 2, timeout=180, env={"OMP_NUM_THREADS": "1"})


def test_stage3_without_optimizer_partitions_and_gathers(job: list[dict[str, Any]]) -> None:
    for result in job:
        case = result["noopt"]
        assert case["forward_diff"] < 1e-6
        assert case["partitioned"]
        assert case["gathered_diff"] == 0.0
        assert "no optimizer" in case["backward"] and "no optimizer" in case["step"]
        assert case["get_lr"] == []
        assert "needs an optimizer" in case["stage1"] and "needs an optimizer" in case["stage2"]
    rank0 = job[0]["noopt"]
    assert rank0["state_dict_diff"] == 0.0 and rank0["saved_diff"] == 0.0
    assert rank0["saved_keys"] == ["0.bias", "0.weight", "2.bias", "2.weight"]


@pytest.mark.parametrize("stage", ["0", "1", "2", "3"])
def test_parameter_frozen_after_initialize_does_not_move(job: list[dict[str, Any]],
                                                         stage: str) -> None:
    for result in job:
        case = result["refreeze"][stage]
        assert case["frozen_moved"] == 0.0
        if stage in ("1", "2"):
            assert case["no_backward_moved"] == 0.0


def test_stage0_frozen_has_no_grad_and_unfrozen_trains(job: list[dict[str, Any]]) -> None:
    for result in job:
        case = result["stage0"]
        assert case["frozen_grad_none"]
        assert case["frozen_moved"] == 0.0
        assert case["unfrozen_moved"] > 0.0
        assert case["fp16_unfrozen"]["frozen_moved"] == 0.0
        assert case["fp16_unfrozen"]["moved"] > 0.0
    assert job[0]["stage0"]["unfrozen_value"] == job[1]["stage0"]["unfrozen_value"]
    assert job[0]["stage0"]["fp16_unfrozen"]["value"] == job[1]["stage0"]["fp16_unfrozen"]["value"]


def test_fp16_stage0_frozen_weight_written_after_initialize_is_kept(
        job: list[dict[str, Any]]) -> None:
    """Its fp32 master, made at initialize(), neither overwrites it at a
    step nor is what the checkpoint saves, and it trains from the written
    value once unfrozen."""
    for result in job:
        case = result["fp16_edited"]
        assert case.get("error") is None, case
        assert case["after_step"] == 0.0
        assert case["unfrozen_moved"] and case["unfrozen_from"] < 0.05, case
    assert job[0]["fp16_edited"]["saved"] == 0.0


@pytest.mark.parametrize("stage", ["0", "2", "3"])
def test_trainable_parameter_in_no_group_is_not_trained(job: list[dict[str, Any]],
                                                        stage: str) -> None:
    for result in job:
        case = result["unlisted"][stage]
        assert case["unlisted_moved"] == 0.0
        assert case["listed_moved"] > 0.0
        if stage == "3":  # its partition-only hooks drop the gradient at once
            assert case["unlisted_grad_none"]


@pytest.mark.parametrize("stage", ["0", "3"])
def test_empty_param_group_is_dropped(job: list[dict[str, Any]], stage: str) -> None:
    for result in job:
        case = result["empty_group"][stage]
        assert case["groups"] == 2 and len(case["lrs"]) == 2



def test_empty_group_under_a_client_scheduler_is_refused(job: list[dict[str, Any]]) -> None:
    for result in job:
        assert "param group(s) 1 of the optimizer" in result["empty_group_scheduler"]


KEYS = ["0.bias", "0.weight", "2.bias", "2.weight"]


@pytest.mark.parametrize("case", ["frozen_init0", "frozen_init1", "frozen_init2",
                                  "frozen_init3", "refreeze1", "refreeze2", "refreeze3",
                                  "unlisted3", "noopt3"])
def test_checkpoint_saves_loads_and_excludes_what_was_frozen(job: list[dict[str, Any]],
                                                             case: str) -> None:
    for result in job:
        saved = result["saved"][case]
        assert saved.get("error") is None
        assert saved["loaded"] and saved["diff"] == 0.0
    frozen = case.startswith(("frozen_init", "refreeze"))
    assert job[0]["saved"][case]["kept"] == [k for k in KEYS if not (frozen and k == "0.weight")]


def test_adamw_checkpoint_loads_into_stage3_engine_without_optimizer(
        job: list[dict[str, Any]]) -> None:
    for result in job:
        case = result["adamw_into_noopt"]
        assert case.get("error") is None
        assert case["loaded"] and case["diff"] == 0.0
