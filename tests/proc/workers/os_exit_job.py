"""Two ranks save tag ``t1``; then rank ``--exiter`` leaves through
``os._exit(0)`` (no Python exit path: it posts no exit mark of its own)
while the other saves ``t2``, for tests/proc/test_checkpoint_agent_mark.py.
The saving rank writes the error it got and how long the save took to
``OUT/saver.json``; ``checkpoint.timeout`` is ``--timeout``.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist

import dsrun


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--exiter", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=60.0)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    dsrun.init_distributed()
    rank = dist.get_rank()
    torch.manual_seed(0)
    config = {"train_micro_batch_size_per_gpu": 1, "steps_per_print": 1000,
              "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
              "zero_optimization": {"stage": 1}, "checkpoint": {"timeout": args.timeout}}
    engine = dsrun.initialize(model=torch.nn.Linear(4, 2), config=config)[0]
    ckpt = os.path.join(args.out, "ckpt")
    engine.save_checkpoint(ckpt, tag="t1")  # type: ignore[attr-defined]
    if rank == args.exiter:
        os._exit(0)
    start = time.monotonic()
    error = None
    try:
        engine.save_checkpoint(ckpt, tag="t2")  # type: ignore[attr-defined]
    except Exception as exc:  # noqa: BLE001 - written for the test
        error = f"{type(exc).__name__}: {exc}"
    with open(os.path.join(args.out, "saver.json"), "w", encoding="utf-8") as f:
        json.dump({"rank": rank, "error": error, "seconds": time.monotonic() - start}, f)
    if error:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
