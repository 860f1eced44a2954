"""Parameters that get two gradients in one backward through torch's
*reentrant* activation checkpoint, trained by the engine at ZeRO stages 0,
2 and 3 and by plain torch (tests/dist/test_reentrant_reuse.py).

A parameter used inside a reentrant checkpoint gets its gradient in the
checkpoint's nested backward pass; used again - in another checkpoint or
outside - it gets a second one in the same backward:

* **shared**: one block called twice, each call under its own checkpoint
  (ALBERT-style shared layers with HF ``gradient_checkpointing``);
* **tied**: an embedding used outside the checkpoint, its tied head inside;
* **inout**: a Linear used both outside and inside a checkpointed region;
* **allin**: the whole loss inside one checkpoint (the engine's output is
  the checkpoint's own output), trained with ``loss.backward()``;
* **varying**: one block applied, each time under its own checkpoint, a
  number of times that differs by rank and step (:data:`REPEATS`: a
  data-dependent depth, LayerDrop or early exit over shared layers).

The reference is plain single-process torch without checkpointing: the
mean over the ranks' batches, summed over the micro-batches, SGD.
:func:`train` and :func:`reference` are also run at world size 1 by the
test itself. Usage: ``dsrun --num_gpus 2 reentrant_reuse.py OUT_DIR``
(writes ``OUT_DIR/rank{R}.json``).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn

import dsrun
from dsrun.errors import DsrunError

D = 8
GA = 2
STEPS = 3
LR = 0.1


def reentrant(fn: Callable[..., Any], *args: Any) -> Any:
    return torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=True)


def plain(fn: Callable[..., Any], *args: Any) -> Any:
    return fn(*args)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l = nn.Linear(D, D)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.l(h))


class Shared(nn.Module):
    def __init__(self, ck: Callable[..., Any]) -> None:
        super().__init__()
        self.ck, self.inp, self.blk, self.head = ck, nn.Linear(D, D), Block(), nn.Linear(D, 1)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.ck(self.blk, self.ck(self.blk, self.inp(x)))
        return F.mse_loss(self.head(h).squeeze(-1), y)


class Tied(nn.Module):
    def __init__(self, ck: Callable[..., Any]) -> None:
        super().__init__()
        self.ck, self.emb, self.blk, self.head = ck, nn.Embedding(12, D), Block(), nn.Linear(D, 12)
        self.head.weight = self.emb.weight

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        logits = self.ck(lambda t: self.head(self.blk(t)), self.emb(x).mean(1))
        return F.cross_entropy(logits, y)


class InOut(nn.Module):
    def __init__(self, ck: Callable[..., Any]) -> None:
        super().__init__()
        self.ck, self.inp, self.l = ck, nn.Linear(D, D), nn.Linear(D, D)
        self.blk, self.head = Block(), nn.Linear(D, 1)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.ck(lambda t: self.blk(self.l(t)), torch.tanh(self.l(self.inp(x))))
        return F.mse_loss(self.head(h).squeeze(-1), y)


class AllIn(nn.Module):
    def __init__(self, ck: Callable[..., Any]) -> None:
        super().__init__()
        self.ck, self.l1, self.blk, self.head = ck, nn.Linear(D, D), Block(), nn.Linear(D, 1)

    def loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(self.head(self.blk(torch.tanh(self.l1(x)))).squeeze(-1), y)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        # the input requires grad: a reentrant checkpoint's output needs one that does
        return self.ck(self.loss, x.detach().requires_grad_(), y)


class Varying(nn.Module):
    def __init__(self, ck: Callable[..., Any]) -> None:
        super().__init__()
        self.ck, self.inp, self.blk, self.head = ck, nn.Linear(D, D), Block(), nn.Linear(D, 1)

    def forward(self, x: torch.Tensor, y: torch.Tensor, repeats: int) -> torch.Tensor:
        h = self.inp(x)
        for _ in range(repeats):
            h = self.ck(self.blk, h)
        return F.mse_loss(self.head(h).squeeze(-1), y)


MODELS = {"shared": Shared, "tied": Tied, "inout": InOut, "allin": AllIn, "varying": Varying}
#: "varying": how often rank R applies the block in step S's synchronising
#: (last) micro-batch: different counts at once, then a learned count that
#: one rank undercuts, then the same count everywhere again
REPEATS = {(0, 0): 2, (1, 0): 1, (0, 1): 1, (1, 1): 2, (0, 2): 2, (1, 2): 2}


def build(case: str, ck: Callable[..., Any]) -> nn.Module:
    torch.manual_seed(0)
    return MODELS[case](ck)


def batch(case: str, rank: int, step: int, micro: int) -> tuple[Any, ...]:
    g = torch.Generator().manual_seed(1000 * step + 10 * rank + micro)
    if case == "tied":
        return torch.randint(0, 12, (4, 3), generator=g), torch.randint(0, 12, (4,), generator=g)
    if case == "varying":
        repeats = REPEATS[rank % 2, step] if micro == GA - 1 else 1 + (rank + step) % 2
        return torch.randn(4, D, generator=g), torch.randn(4, generator=g), repeats
    return torch.randn(4, D, generator=g), torch.randn(4, generator=g)


def reference(case: str, world: int) -> dict[str, list[float]]:
    """Plain torch, no checkpointing, every rank's batches in one process."""
    model = build(case, plain)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for step in range(STEPS):
        opt.zero_grad()
        for micro in range(GA):
            for rank in range(world):
                (model(*batch(case, rank, step, micro)) / (GA * world)).backward()
        opt.step()
    return {n: p.detach().reshape(-1).tolist() for n, p in model.named_parameters()}


def train(case: str, stage: int, zero: dict[str, Any], torch_backward: bool = False
          ) -> dict[str, Any]:
    """The engine over reentrant checkpoints: final full parameters, and at
    stage 0 how many extra all-reduces the gradient sync ran."""
    config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": GA,
              "optimizer": {"type": "SGD", "params": {"lr": LR}},
              "zero_allow_untested_optimizer": True, "gradient_clipping": 0.0,
              "zero_optimization": {"stage": stage, **zero}, "steps_per_print": 10**9}
    engine, *_ = dsrun.initialize(model=build(case, reentrant), config=config)
    extra = [0]
    sync = getattr(engine, "_grad_sync", None)
    reduce_extra = getattr(sync, "_reduce_extra", None)
    if reduce_extra is not None:

        def counted(*args: Any) -> None:
            extra[0] += 1
            reduce_extra(*args)
        sync._reduce_extra = counted
    rank = dist.get_rank()
    try:
        for step in range(STEPS):
            for micro in range(GA):
                loss = engine(*batch(case, rank, step, micro))
                if torch_backward:
                    loss.backward()
                else:
                    engine.backward(loss)
                engine.step()
        with dsrun.zero.GatheredParameters(list(engine.module.parameters())):
            params = {n: p.detach().reshape(-1).tolist()
                      for n, p in engine.module.named_parameters()}
    except DsrunError as err:
        return {"error": str(err)}
    finally:
        engine.destroy()
    return {"params": params, "extra_reductions": extra[0]}


SMALL_BUCKETS = {"reduce_bucket_size": D}  # one parameter a bucket: launched during backward
RUNS: dict[str, tuple[str, int, dict[str, Any], bool]] = {
    "s3_shared": ("shared", 3, {"stage3_param_persistence_threshold": 0}, False),
    "s3_shared_persistent": ("shared", 3, {}, False),
    "s3_tied": ("tied", 3, {"stage3_param_persistence_threshold": 0}, False),
    "s3_inout": ("inout", 3, {"stage3_param_persistence_threshold": 0}, False),
    "s0_shared": ("shared", 0, {}, False),
    "s0_shared_small_buckets": ("shared", 0, SMALL_BUCKETS, False),
    "s0_tied": ("tied", 0, {}, False),
    "s0_tied_small_buckets": ("tied", 0, SMALL_BUCKETS, False),
    "s0_inout_small_buckets": ("inout", 0, SMALL_BUCKETS, False),
    "s0_allin_torch_backward": ("allin", 0, {}, True),
    "s0_varying": ("varying", 0, {}, False),
    "s0_varying_small_buckets": ("varying", 0, SMALL_BUCKETS, False),
    "s3_allin_torch_backward": ("allin", 3, {"stage3_param_persistence_threshold": 0}, True),
    "s2_shared": ("shared", 2, {}, False),
}


def main() -> None:
    out_dir = Path(sys.argv[1])
    dsrun.init_distributed(dist_backend="gloo")
    world = dist.get_world_size()
    cases = sorted({case for case, *_ in RUNS.values()})
    result = {"rank": dist.get_rank(),
              "reference": {case: reference(case, world) for case in cases},
              "runs": {name: train(case, stage, zero, tb)
                       for name, (case, stage, zero, tb) in RUNS.items()}}
    (out_dir / f"rank{dist.get_rank()}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
