"""A parameter that gets two gradients in one backward through torch's
reentrant activation checkpoint (a block shared by two checkpoints, a tied
embedding/head, a Linear inside and outside a checkpoint), and a loss that
is itself a reentrant checkpoint's output, backwarded by ``loss.backward()``
(workers/reentrant_reuse.py: one 2-rank dsrun job runs every case; the
world-size-1 offload case runs here in ``solo``). Each is compared with
plain single-process torch without checkpointing, within 1e-6 (fp32, SGD,
gradient accumulation 2, 3 steps).

Before: stage 3 copied each landing of a step's first round over the last,
so a second gradient replaced the first (off by ~1e-2); stage 0 stopped
with an error blaming the script's backward calls; with the loss the
checkpoint's own output, ``loss.backward()`` was taken for an
``autograd.grad``-style pass - no division by the accumulation steps and,
at stage 0, no all-reduce (the replicas drifted apart); stage 2, which
refuses the case as DeepSpeed's does, advised "one backward per
micro-batch".
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.conftest import ROOT, rank_results
from tests.dist.workers import reentrant_reuse as worker

pytestmark = pytest.mark.dist

WORKER = ROOT / "tests" / "dist" / "workers" / "reentrant_reuse.py"
TOLERANCE = 1e-6


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out = tmp_path_factory.mktemp("reentrant_reuse")
    return rank_results(WORKER, out, 2, timeout=240, env={"OMP_NUM_THREADS": "1"})


def _max_diff(got: dict[str, list[float]], want: dict[str, list[float]]) -> float:
    assert got.keys() == want.keys()
    return max(abs(a - b) for name in want for a, b in zip(got[name], want[name], strict=True))


def _check(run: dict[str, Any], reference: dict[str, list[float]], where: str) -> None:
    assert "error" not in run, f"{where}: {run.get('error')}"
    diff = _max_diff(run["params"], reference)
    assert diff <= TOLERANCE, f"{where}: parameters {diff:.3g} from plain torch"


def _check_run(job: list[dict[str, Any]], name: str) -> None:
    case = worker.RUNS[name][0]
    for result in job:
        _check(result["runs"][name], result["reference"][case], f"{name}, rank {result['rank']}")


@pytest.mark.parametrize("name", ["s3_shared", "s3_shared_persistent", "s3_tied", "s3_inout"])
def test_stage3_sums_both_gradients(job: list[dict[str, Any]], name: str) -> None:
    _check_run(job, name)


@pytest.mark.parametrize("name", ["s0_shared", "s0_shared_small_buckets", "s0_tied",
                                  "s0_tied_small_buckets", "s0_inout_small_buckets"])
def test_stage0_sums_both_gradients_before_reducing(job: list[dict[str, Any]],
                                                     name: str) -> None:
    _check_run(job, name)


@pytest.mark.parametrize("name", ["s0_shared_small_buckets", "s0_tied_small_buckets",
                                  "s0_inout_small_buckets"])
def test_stage0_reduces_again_only_until_it_has_learned_the_count(
        job: list[dict[str, Any]], name: str) -> None:
    """The first synchronising backward launched the reused parameter's
    bucket before its second gradient and all-reduced it again afterwards;
    the two later ones waited for the second gradient: no extra reduction."""
    for result in job:
        assert result["runs"][name].get("extra_reductions") == 1, result["runs"][name]


@pytest.mark.parametrize("name", ["s0_allin_torch_backward", "s3_allin_torch_backward"])
def test_loss_returned_by_a_reentrant_checkpoint_is_a_training_backward(
        job: list[dict[str, Any]], name: str) -> None:
    _check_run(job, name)


@pytest.mark.parametrize("name", ["s0_varying", "s0_varying_small_buckets"])
def test_stage0_ranks_reusing_a_block_a_different_number_of_times_agree(
        job: list[dict[str, Any]], name: str) -> None:
    """Rank 0 applies the checkpointed block twice and rank 1 once, then the
    other way round, then both twice (workers/reentrant_reuse.py, REPEATS):
    the ranks decide together whether to reduce the extra gradients, and
    train as plain torch does. Before: only the ranks with extra gradients
    ran the extra all-reduce - rank 0 waited in it until rank 1 exited."""
    _check_run(job, name)
    counts = {result["runs"][name].get("extra_reductions") for result in job}
    assert len(counts) == 1 and counts.pop() >= 1, "the ranks ran different reductions"


def test_stage2_names_the_reentrant_checkpoint(job: list[dict[str, Any]]) -> None:
    for result in job:
        error = result["runs"]["s2_shared"].get("error", "")
        assert "received gradients twice in one backward pass" in error, error
        assert "reentrant activation checkpoints" in error and "use_reentrant=False" in error
        assert "tied" in error and "one backward per micro-batch" not in error


@pytest.mark.parametrize("case", ["shared", "inout"])
def test_stage3_world1_offload_param_sums_both_gradients(solo: None, case: str) -> None:
    run = worker.train(case, 3, {"offload_param": {"device": "cpu"},
                                 "offload_optimizer": {"device": "cpu"}})
    _check(run, worker.reference(case, 1), f"{case}, world size 1")


def test_stage0_refuses_an_extra_gradient_added_into_a_reduced_slot(solo: None) -> None:
    """The first backward that reuses a parameter, after a synchronising one
    whose reduced gradients are still the ``.grad`` (no zero_grad between):
    autograd added the second gradient into the bucket memory that the
    first had filled, so the sum cannot be recovered - refused, naming the
    parameter and what to do (before: an error blaming the backward calls)."""
    import torch

    from dsrun.errors import DsrunError
    from dsrun.runtime.grad_sync import GradSync

    model = worker.build("shared", worker.reentrant)
    names, params = zip(*model.named_parameters())
    sync = GradSync(list(params), names=list(names))
    x, y = worker.batch("shared", 0, 0, 0)
    sync.arm()
    torch.nn.functional.mse_loss(model.head(model.blk(model.inp(x))).squeeze(-1), y).backward()
    sync.finish()  # blk used once: one gradient each, .grad now views of the buckets
    sync.arm()
    with pytest.raises(DsrunError, match=r"blk\.l\.\w+ received another gradient .* zero the "
                                         r"gradients .* use_reentrant=False"):
        model(x, y).backward()


def test_stage0_off_cpu_refuses_reuse_first_seen_after_the_first_backward(solo: None) -> None:
    """Off CPU, reading the ranks' extra-gradient flag is a host sync, so
    after a first synchronising backward in which no rank reused a
    parameter the ranks stop reading it: a later reuse is refused on the
    rank that sees it, naming the parameter, instead of one rank running an
    all-reduce the others do not (simulated here on CPU)."""
    from dsrun.errors import DsrunError
    from dsrun.runtime.grad_sync import GradSync

    model = worker.build("varying", worker.reentrant)
    names, params = zip(*model.named_parameters())
    sync = GradSync(list(params), names=list(names))
    sync._keep_probing = False  # as on an accelerator
    x, y, _ = worker.batch("varying", 0, 0, 0)
    sync.arm()
    model(x, y, 1).backward()
    sync.finish()
    model.zero_grad(set_to_none=True)
    sync.arm()
    model(x, y, 2).backward()
    with pytest.raises(DsrunError, match=r"blk\.l\.\w+, .*more than one gradient .* first "
                                         r"synchronising backward.*use_reentrant=False"):
        sync.finish()
