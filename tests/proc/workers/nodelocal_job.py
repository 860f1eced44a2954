"""Two ranks whose checkpoint directories are private to each (as on
node-local storage), for tests/proc/test_checkpoint_nodelocal.py.

Each rank passes its own path (``OUT/hostR/...``), which is what one path
on two hosts' local disks amounts to. ``--mode sync``: the loads (two
different checkpoints under one tag, different ``latest`` files, a tag
one rank lacks), then a save; ``--mode async``: a save with
``"checkpoint": {"async": true}``. Each case's error (or None), how long
it took and whether the engine changed go to ``OUT/rankR.json``; the job
succeeds.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any, Callable

import torch
import torch.distributed as dist

import dsrun


def weights(engine: Any) -> list[float]:
    return [float(p.detach().double().sum()) for p in engine.module.parameters()]


def train(engine: Any, steps: int) -> None:
    for i in range(steps):
        x = torch.full((1, 4), float(i + 1))
        loss = engine(x).pow(2).sum()
        engine.backward(loss)
        engine.step()


def attempt(engine: Any, run: Callable[[], Any]) -> dict[str, Any]:
    before, start = weights(engine), time.monotonic()
    try:
        run()
        error = None
    except Exception as exc:  # noqa: BLE001 - recorded for the test
        error = f"{type(exc).__name__}: {exc}"
    return {"error": error, "seconds": time.monotonic() - start,
            "unchanged": weights(engine) == before}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", required=True, choices=("sync", "async"))
    parser.add_argument("--timeout", type=float, default=20.0)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    dsrun.init_distributed()
    rank = dist.get_rank()
    torch.manual_seed(0)
    config = {"train_micro_batch_size_per_gpu": 1, "steps_per_print": 1000,
              "optimizer": {"type": "AdamW", "params": {"lr": 0.01}},
              "zero_optimization": {"stage": 1},
              "checkpoint": {"timeout": args.timeout, "async": args.mode == "async"}}
    engine = dsrun.initialize(model=torch.nn.Linear(4, 2), config=config)[0]
    out, mine = args.out, os.path.join(args.out, f"host{rank}")
    results: dict[str, Any] = {}
    if args.mode == "sync":
        shared_a, shared_b = os.path.join(out, "ckA"), os.path.join(out, "ckB")
        train(engine, 1)
        engine.save_checkpoint(shared_a, tag="t")
        train(engine, 1)
        engine.save_checkpoint(shared_b, tag="t")
        train(engine, 1)
        # rank 0's view of "ck" holds one checkpoint 't', rank 1's another
        results["mixed"] = attempt(engine, lambda: engine.load_checkpoint(
            shared_a if rank == 0 else shared_b))
        results["latest"] = attempt(engine, lambda: engine.load_checkpoint(
            shared_a if rank == 0 else mine))
        results["tag"] = attempt(engine, lambda: engine.load_checkpoint(
            shared_a if rank == 0 else mine, tag="t"))
    results["save"] = attempt(engine, lambda: (engine.save_checkpoint(
        os.path.join(mine, "ck"), tag="u"), engine.wait_for_checkpoint()))
    results["left"] = sorted(os.listdir(os.path.join(mine, "ck"))) \
        if os.path.isdir(os.path.join(mine, "ck")) else []
    # the engine still saves and loads in a shared directory afterwards
    results["after"] = attempt(engine, lambda: (engine.save_checkpoint(
        os.path.join(out, "ckC"), tag="v"), engine.wait_for_checkpoint(),
        engine.load_checkpoint(os.path.join(out, "ckC"))))
    with open(os.path.join(out, f"rank{rank}.json"), "w", encoding="utf-8") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main()
