"""Pipeline state one stage holds differently from another, on 2 gloo ranks
(one dsrun job for the module, ``workers/pipe_stage_cases.py``): a
trainable ``loss_fn`` (only the last stage's copy trains) in checkpoints
and 16-bit saves; a frozen stage whose parameters ``model_parameters``
leaves out; a loss scale a script writes at stage 0 under fp16; a
generator of parameters inside a param-group dict; the first stage's data
running out inside a batch."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from dsrun.runtime.pipe.step import _given_count
from tests.conftest import ROOT, dsrun_argv
from tests.dist.test_engine_dist import _run, case

pytestmark = pytest.mark.dist

WORKER = ROOT / "tests" / "dist" / "workers" / "pipe_stage_cases.py"


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out, ckpt = tmp_path_factory.mktemp("stage_state"), tmp_path_factory.mktemp("ckpt")
    results = _run(dsrun_argv("--cpu", "--num_gpus", "2", str(WORKER), "--out", str(out),
                              "--ckpt", str(ckpt)), out)
    assert [r["world_size"] for r in results] == [2, 2]
    return results


def test_a_trainable_loss_fn_resumes_bitwise(ranks: list[dict[str, Any]]) -> None:
    """The checkpoint holds the last stage's trained ``log_var`` (stage 0's
    copy never trains), so the resumed run is the straight run."""
    facts = case(ranks, "loss_param")
    last = next(f for f in facts if f["stage"] == 1)
    first = next(f for f in facts if f["stage"] == 0)
    assert first["straight_value"] == 0.0 and last["straight_value"] != 0.0
    assert last["resumed"] == last["straight"]
    assert last["resumed_value"] == last["straight_value"]


def test_save_16bit_model_holds_the_trained_loss_fn(ranks: list[dict[str, Any]]) -> None:
    facts = case(ranks, "loss_param")
    last = next(f for f in facts if f["stage"] == 1)
    assert facts[0]["saved16"] == last["straight_value"]


def test_a_frozen_stage_left_out_of_model_parameters_is_named(
        ranks: list[dict[str, Any]]) -> None:
    for fact in case(ranks, "frozen_filtered"):
        error = fact["error"]
        assert error is not None and "empty parameter list" not in error, error
        assert "pipeline stage 0 (layers 0-1: Linear, Tanh)" in error, error
        assert "model_parameters" in error and "requires_grad=False" in error, error


def test_every_stage_takes_a_scale_written_to_optimizer_cur_scale(
        ranks: list[dict[str, Any]]) -> None:
    """fp16 at ZeRO stage 0: a write to ``optimizer.cur_scale`` (which only
    the last stage's loss scaling used to take) is the scale every stage
    unscales by, so each stage's update is the one the
    ``loss_scaler.cur_scale`` route gives."""
    for stage, fact in enumerate(case(ranks, "written_scale")):
        direct, written = fact["loss_scaler.cur_scale"], fact["cur_scale"]
        assert written["scale"] == written["published"] == 8.0, (stage, written)
        assert direct["moved"] > 0
        assert abs(written["moved"] - direct["moved"]) <= 1e-6 * direct["moved"], \
            (stage, written, direct)


def test_a_generator_inside_a_param_group_still_trains(ranks: list[dict[str, Any]]) -> None:
    for fact in case(ranks, "group_generator"):
        assert fact["held"] == fact["owned"] > 0, fact
        assert fact["moved"] > 0, fact


def test_given_count_reads_no_generator() -> None:
    """A group's generator is read once: it is left for the optimizer (None:
    not counted), like a top-level one."""
    params = list(torch.nn.Linear(2, 2).parameters())
    inner = (p for p in params)
    assert _given_count([{"params": inner, "lr": 0.1}]) is None
    assert list(inner) == params
    assert _given_count(p for p in params) is None
    assert _given_count([{"params": params}, {"params": params[0]}, params[1]]) == 4
    assert _given_count([{"params": ()}]) == 0


def test_the_next_stage_says_the_first_stages_data_ran_out(
        ranks: list[dict[str, Any]]) -> None:
    first, second = (f["errors"] for f in case(ranks, "exhausted"))
    assert first[0].startswith("DataIteratorExhausted: the data iterator ran out at "
                               "micro-batch 1 of 2"), first
    assert second and second[0].startswith("PipeMessageError"), second
    assert "the first stage's data iterator probably ran out at micro-batch 1 of batch" \
        in second[0], second
