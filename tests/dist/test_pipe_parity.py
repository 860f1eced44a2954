"""Pipeline parallelism against one process: 2 stages on 2 gloo ranks and
2 stages x 2 replicas on 4 ranks, trained 10 steps, give the losses and
parameters of the same layers trained in one process with the same
micro-batches (<= 1e-6; bitwise where nothing is reduced in another order).

Each world size is one dsrun job (workers/pipe_cases.py runs every case in
it); the reference is trained here, in this process, as a one-stage
PipelineModule of the same layer list - so names must match too: the union
of the stages' parameter names (tied ones once) is the one-stage model's.

Why not always bitwise: with clipping, the global norm is summed from the
stages' shares (float64 squares, one all-reduce) rather than torch's norm of
per-parameter norms; with 2 replicas, each replica's accumulated gradient
is averaged (``a/2 + b/2``) where the reference accumulates all micro-batches
in one sum; a tied weight's gradient is ``sum(a_k) + sum(b_k)`` (each
stage's accumulation, then the tied all-reduce) where one process
accumulates ``sum(a_k + b_k)``.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.conftest import run_dsrun
from tests.dist.pipe_support import WORKER, load_cases

pytestmark = pytest.mark.dist

TOLERANCE = 1e-6
cases = load_cases()

ON_2_RANKS = ["mlp", "mlp-noclip", "mlp-3mb", "mlp-ckpt", "mlp-reentrant", "inplace",
              "mlp-zero1", "mlp-bf16", "tied", "varlen", "tuple", "mlp-flops"]
ON_4_RANKS = ["mlp", "mlp-zero1", "mlp-zero2", "mlp-ckpt", "tied", "tied-zero1", "mlp-aux"]
BITWISE_ON_2_RANKS = ["mlp-noclip", "mlp-3mb"]


@pytest.fixture(scope="module")
def one_process() -> Iterator[None]:
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _job(world: int, names: list[str], out: Path) -> dict[str, list[dict[str, Any]]]:
    res = run_dsrun("--cpu", "--num_gpus", str(world), str(WORKER), str(out), *names,
                    timeout=240)
    assert res.returncode == 0, res.stderr[-4000:]
    return {name: [torch.load(out / f"{name}-rank{r}.pt", weights_only=False)
                   for r in range(world)] for name in names}


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    return _job(2, ON_2_RANKS, tmp_path_factory.mktemp("pipe2"))


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    return _job(4, ON_4_RANKS, tmp_path_factory.mktemp("pipe4"))


def reference(name: str, replicas: int) -> dict[str, Any]:
    """The case trained in this process: a one-stage PipelineModule, a plain loop."""
    case = cases.CASES[name]
    module = cases.build(name, 1)
    opt = torch.optim.AdamW(module.parameters(), lr=0.01, weight_decay=0.01)
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=case.bf16)
    losses, additional = [], []
    for step in range(cases.STEPS):
        micro = [mb for r in range(replicas) for mb in case.batch(step, r)]
        total = torch.zeros(())
        extra: dict[str, float] = {}
        for x, y in micro:
            with autocast:
                out = module(x)
            loss = case.loss_fn(out, y)
            (loss / len(micro) if len(micro) > 1 else loss).backward()
            total += loss.detach().float()
            for key, value in (module.get_additional_losses() or {}).items():
                extra[key] = extra.get(key, 0.0) + float(value) / len(micro)
        losses.append(float(total / len(micro)))
        additional.append(extra or None)
        if case.clip:
            torch.nn.utils.clip_grad_norm_(module.parameters(), case.clip)
        opt.step()
        opt.zero_grad()
    module.eval()
    with torch.no_grad():
        evals = []
        for x, y in case.eval_data():
            with autocast:
                out = module(x)
            evals.append(case.loss_fn(out, y).float())
        with autocast:
            forward = module(case.eval_data()[0][0])
    return {"losses": losses, "eval": float(torch.stack(evals).mean()), "forward": forward,
            "additional": additional,
            "params": {n: p.detach().clone() for n, p in module.named_parameters()}}


def _compare(name: str, ranks: list[dict[str, Any]], ref: dict[str, Any], bitwise: bool
             ) -> list[str]:
    report = []
    merged: dict[str, torch.Tensor] = {}
    for rank, got in enumerate(ranks):
        for key, value in got["params"].items():
            if key in merged:  # a tied copy or another replica: the very same value
                assert torch.equal(merged[key], value), f"{name}: {key} differs on rank {rank}"
            merged[key] = value
        loss_diff = max(abs(a - b) for a, b in zip(got["losses"], ref["losses"]))
        assert loss_diff <= TOLERANCE, f"{name} rank {rank}: losses differ by {loss_diff}"
        assert abs(got["eval"] - ref["eval"]) <= TOLERANCE, (name, got["eval"], ref["eval"])
        # get_additional_losses(): the micro-batches' and replicas' mean, on every rank
        for got_extra, want in zip(got["additional"], ref["additional"], strict=True):
            assert (got_extra is None) == (want is None), (name, rank, got_extra)
            if want is not None:
                assert list(got_extra) == list(want), (name, rank, got_extra)
                assert all(abs(got_extra[k][0] - want[k]) <= TOLERANCE and
                           got_extra[k][1:] == (torch.float32, ()) for k in want), \
                    (name, rank, got_extra, want)
        if bitwise:
            assert got["losses"] == ref["losses"], name
    assert sorted(merged) == sorted(ref["params"]), f"{name}: parameter names differ"
    diff = max((merged[k] - ref["params"][k]).abs().max().item() for k in merged)
    report.append(f"{name}: max param diff {diff:.1e}, final loss {ref['losses'][-1]:.4f} "
                  f"(first {ref['losses'][0]:.4f})")
    assert diff <= TOLERANCE, report[-1]
    if bitwise:
        assert all(torch.equal(merged[k], ref["params"][k]) for k in merged), name
    assert ref["losses"][-1] < ref["losses"][0], f"{name}: the case does not train"
    last = [got["forward"] for got in ranks if got["stage"] == 1]
    assert all(torch.allclose(f, ref["forward"], atol=TOLERANCE, rtol=0) for f in last)
    assert all(got["forward"] is None for got in ranks if got["stage"] == 0)
    # eval_batch(bcast_loss=False): the result on the last stage only
    assert all((got["eval_local"] is None) == (got["stage"] == 0) for got in ranks)
    assert all(got["eval_local"] == got["eval"] for got in ranks if got["stage"] == 1)
    return report


@pytest.mark.parametrize("name", ON_2_RANKS)
def test_two_stages_on_two_ranks(one_process: None, two_ranks: dict, name: str) -> None:
    print(*_compare(name, two_ranks[name], reference(name, 1), name in BITWISE_ON_2_RANKS))


@pytest.mark.parametrize("name", ON_4_RANKS)
def test_two_stages_by_two_replicas_on_four_ranks(one_process: None, four_ranks: dict,
                                                  name: str) -> None:
    ranks = four_ranks[name]
    assert [(r["stage"], r["replica"]) for r in ranks] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    print(*_compare(name, ranks, reference(name, 2), bitwise=False))


def test_partition_by_counted_work(two_ranks: dict) -> None:
    """"flops" puts layers 0-1 on stage 0 (the default, "parameters", 0-2),
    on every rank alike, and the parity test above trains on it."""
    assert [r["parts"] for r in two_ranks["mlp-flops"]] == [(0, 2, 6), (0, 2, 6)]
    assert [r["parts"] for r in two_ranks["mlp"]] == [(0, 3, 6), (0, 3, 6)]


def test_tied_weights_stay_tied(two_ranks: dict, four_ranks: dict) -> None:
    """The embedding (stage 0) and the output layer (stage 1) share one name
    and, after training, bitwise one value on every rank."""
    for job in (two_ranks, four_ranks):
        for name in ("tied", "tied-zero1"):
            if name not in job:
                continue
            copies = [r["params"]["tied_modules.embed.weight"] for r in job[name]]
            assert len(copies) == len(job[name])  # every stage holds the tied module
            assert all(torch.equal(c, copies[0]) for c in copies)
            assert not any(k.startswith(("0.", "4.")) for r in job[name] for k in r["params"])
