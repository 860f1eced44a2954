"""ZeRO stages 1 and 2 (gradients reduced during backward) over reentrant
activation checkpoints whose number differs by rank, the head inside the
last one - so a backward's first gradient arrives in a checkpoint's nested
pass - against plain torch; counts each backward's reduction collectives
(tests/dist/test_zero_nested_rounds.py).

Usage: ``dsrun --num_gpus 2 zero_nested_rounds.py OUT_DIR`` (writes
``OUT_DIR/rank{R}.json``).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn

import dsrun
from dsrun.errors import DsrunError
from dsrun.runtime.zero import reducer as reducer_module

D = 8
VOCAB = 12
STEPS = 3
LR = 0.1

Plan = tuple[tuple[int, ...], ...]  # the blocks each checkpoint runs, in order
#: per (rank, step): rank 0 and 1 run different numbers of checkpoints
UNSHARED: dict[tuple[int, int], Plan] = {
    (0, 0): ((0,), (1,), (2,)), (1, 0): ((0, 1, 2),),
    (0, 1): ((0, 1), (2,)), (1, 1): ((0,), (1,), (2,)),
    (0, 2): ((0, 1, 2),), (1, 2): ((0,), (1, 2)),
}
#: a block reused across checkpoints a number of times that differs by rank
REUSED: dict[tuple[int, int], Plan] = {
    (0, 0): ((0,), (1,), (2,), (2,)), (1, 0): ((0, 1),),
    (0, 1): ((1,),), (1, 1): ((0,), (1,), (1,), (2,)),
    (0, 2): ((2,), (2,)), (1, 2): ((0,), (0, 2)),
}

#: no rank reuses a block in the first backward; then rank 1, then rank 0 does
LATE: dict[tuple[int, int], Plan] = {
    (0, 0): ((0,), (1,), (2,)), (1, 0): ((0, 1), (2,)),
    (0, 1): ((0,), (1,), (2,)), (1, 1): ((0,), (1,), (1,), (2,)),
    (0, 2): ((2,), (2,)), (1, 2): ((0, 1, 2),),
}


def reentrant(fn: Callable[..., Any], *args: Any) -> Any:
    return torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=True)


def plain(fn: Callable[..., Any], *args: Any) -> Any:
    return fn(*args)


class Net(nn.Module):
    """Embedding outside every checkpoint, the head inside the last one
    (``tied``: the head is the embedding's weight)."""

    def __init__(self, ck: Callable[..., Any], tied: bool) -> None:
        super().__init__()
        self.ck, self.emb = ck, nn.Embedding(VOCAB, D)
        self.blocks = nn.ModuleList(nn.Linear(D, D) for _ in range(3))
        self.head = nn.Linear(D, VOCAB, bias=False)
        if tied:
            self.head.weight = self.emb.weight

    def forward(self, x: torch.Tensor, y: torch.Tensor, plan: Plan) -> torch.Tensor:
        h = self.emb(x).mean(1)
        for i, group in enumerate(plan):
            def run(t: torch.Tensor, group: tuple[int, ...] = group,
                    last: bool = i == len(plan) - 1) -> torch.Tensor:
                for j in group:
                    t = torch.tanh(self.blocks[j](t))
                return self.head(t) if last else t
            h = self.ck(run, h)
        return F.cross_entropy(h, y)


CASES = {"unshared": (False, UNSHARED), "tied_reused": (True, REUSED), "late": (False, LATE),
         "tied_unshared": (True, UNSHARED)}


def build(case: str, ck: Callable[..., Any]) -> nn.Module:
    torch.manual_seed(0)
    return Net(ck, CASES[case][0])


def batch(case: str, rank: int, step: int) -> tuple[Any, ...]:
    g = torch.Generator().manual_seed(1000 * step + 10 * rank)
    return (torch.randint(0, VOCAB, (4, 3), generator=g),
            torch.randint(0, VOCAB, (4,), generator=g), CASES[case][1][rank % 2, step])


def reference(case: str, world: int) -> dict[str, list[float]]:
    """Plain torch, no checkpointing, every rank's batch in one process."""
    model = build(case, plain)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for step in range(STEPS):
        opt.zero_grad()
        for rank in range(world):
            (model(*batch(case, rank, step)) / world).backward()
        opt.step()
    return {n: p.detach().reshape(-1).tolist() for n, p in model.named_parameters()}


class _Counting:
    """Stands in for the reducer module's collectives: counts all-reduces."""

    def __init__(self, inner: Any, counts: dict[str, int]) -> None:
        self.inner, self.counts = inner, counts

    def all_reduce(self, *args: Any, **kwargs: Any) -> Any:
        self.counts["all_reduce"] += 1
        return self.inner.all_reduce(*args, **kwargs)


def train(case: str, stage: int, zero: dict[str, Any]) -> dict[str, Any]:
    """Final parameters, and per backward: bucket reductions launched, rounds
    ended, small all-reduces (the extras agreement and extras)."""
    config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1,
              "optimizer": {"type": "SGD", "params": {"lr": LR}},
              "zero_allow_untested_optimizer": True, "gradient_clipping": 0.0,
              "zero_optimization": {"stage": stage,
                                    **{k: v for k, v in zero.items() if k != "_unwatched"}},
              "steps_per_print": 10**9}
    engine, *_ = dsrun.initialize(model=build(case, reentrant), config=config)
    reducer = engine.optimizer._reducer
    if zero.get("_unwatched"):
        reducer._keep_watching = False  # as on an accelerator
    counts = {"launch": 0, "round": 0, "all_reduce": 0}
    launch, round_end = reducer._launch, reducer.on_round_end

    def counted_launch(b: int) -> None:
        counts["launch"] += 1
        launch(b)

    def counted_round_end() -> None:
        counts["round"] += 1
        round_end()
    reducer._launch, reducer.on_round_end = counted_launch, counted_round_end
    inner = reducer_module.collectives
    reducer_module.collectives = _Counting(inner, counts)  # type: ignore[assignment]
    rank = dist.get_rank()
    per_backward: list[dict[str, Any]] = []
    try:
        for step in range(STEPS):
            counts.update(launch=0, round=0, all_reduce=0)
            engine.backward(engine(*batch(case, rank, step)))
            per_backward.append({**counts, "had_extra": reducer._had_extra})
            engine.step()
        params = {n: p.detach().reshape(-1).tolist() for n, p in engine.module.named_parameters()}
    except DsrunError as err:
        return {"error": str(err), "per_backward": per_backward}
    finally:
        reducer_module.collectives = inner
        engine.destroy()
    return {"params": params, "per_backward": per_backward, "buckets": len(reducer.buckets)}


SMALL = {"reduce_bucket_size": D * D}  # about one parameter a bucket: sent during backward
RUNS: dict[str, tuple[str, int, dict[str, Any]]] = {
    "s1_unshared": ("unshared", 1, SMALL),
    "s1_tied_reused": ("tied_reused", 1, SMALL),
    "s1_tied_reused_default_buckets": ("tied_reused", 1, {}),
    "s1_tied_reused_overlap": ("tied_reused", 1, {**SMALL, "overlap_comm": True}),
    # on CPU the ranks agree on extra gradients every backward: a reuse first
    # seen in a later one is summed (before: refused on the rank that saw it)
    "s1_late_reuse": ("late", 1, SMALL),
    # where that agreement stops (an accelerator): refused on every rank
    "s1_late_reuse_unwatched": ("late", 1, {**SMALL, "_unwatched": True}),
    "s2_unshared": ("unshared", 2, SMALL),
    "s2_unshared_default_buckets": ("unshared", 2, {}),
    "s2_unshared_overlap": ("unshared", 2, {**SMALL, "overlap_comm": True}),
    # the tied weight's second gradient (outside) in the round its first
    # (inside the last checkpoint) opened: refused, as DeepSpeed's stage 2 does
    "s2_tied_refused": ("tied_unshared", 2, SMALL),
}


class AllInside(nn.Module):
    """Every parameter inside a reentrant checkpoint: each gradient of a
    backward arrives in a nested pass, none in the outermost one."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(D, D), nn.Linear(D, 1)

    def forward(self, x: torch.Tensor, ck: Callable[..., Any] = reentrant) -> torch.Tensor:
        return ck(self.b, torch.tanh(ck(self.a, x)))


DIRECT_STEPS = 2
#: (stage, gradient_accumulation_steps); stage 1 reduces during backward only at GA 1
DIRECT = ((1, 2), (2, 2), (1, 1))


def direct_batch(rank: int, step: int, micro: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 * step + 10 * micro + rank)
    # requires grad: a reentrant checkpoint's output needs an input that does
    return torch.randn(4, D, generator=g).requires_grad_()


def direct_reference(world: int, ga: int) -> dict[str, list[float]]:
    """Plain torch: a loss that skips the engine's forward is not divided by
    the accumulation steps, only averaged over the ranks."""
    model = AllInside()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for step in range(DIRECT_STEPS):
        opt.zero_grad()
        for micro in range(ga):
            for rank in range(world):
                (model(direct_batch(rank, step, micro), plain).square().mean() / world).backward()
        opt.step()
    return {n: p.detach().reshape(-1).tolist() for n, p in model.named_parameters()}


def train_direct(stage: int, ga: int) -> dict[str, Any]:
    """``loss.backward()`` on ``engine.module(x)`` (no engine forward, so no
    engine ``finish()`` after it): whether the reducer's round is still open
    after each backward (None: no reducer), and the final parameters."""
    config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": ga,
              "optimizer": {"type": "SGD", "params": {"lr": LR}},
              "zero_allow_untested_optimizer": True, "gradient_clipping": 0.0,
              "zero_optimization": {"stage": stage}, "steps_per_print": 10**9}
    engine, *_ = dsrun.initialize(model=AllInside(), config=config)
    reducer, rank = engine.optimizer._reducer, dist.get_rank()
    open_after: list[Optional[bool]] = []
    try:
        for step in range(DIRECT_STEPS):
            for micro in range(ga):
                engine.module(direct_batch(rank, step, micro)).square().mean().backward()
                open_after.append(None if reducer is None else reducer.active)
                engine.step()
        params = {n: p.detach().reshape(-1).tolist() for n, p in engine.module.named_parameters()}
    except DsrunError as err:
        return {"error": str(err), "open_after": open_after}
    finally:
        engine.destroy()
    return {"params": params, "open_after": open_after}


def main() -> None:
    out_dir = Path(sys.argv[1])
    dsrun.init_distributed(dist_backend="gloo")
    world = dist.get_world_size()
    result = {"rank": dist.get_rank(),
              "reference": {case: reference(case, world) for case in CASES},
              "runs": {name: train(*run) for name, run in RUNS.items()},
              "direct_reference": {ga: direct_reference(world, ga) for ga in (1, 2)},
              "direct": {f"s{stage}_ga{ga}": train_direct(stage, ga) for stage, ga in DIRECT}}
    (out_dir / f"rank{dist.get_rank()}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
