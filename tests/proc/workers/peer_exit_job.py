"""Two ranks save tag ``t1``, then one rank leaves while the other saves
``t2``, for tests/proc/test_checkpoint_peer_exit.py.

``--mode before``: rank ``--exiter`` calls ``sys.exit(0)`` instead of the
save (as a SIGTERM handler that exits at once does). ``--mode during``: it
calls ``sys.exit(0)`` from inside its write of the save (as a signal
handler that lands there does). ``--sleep``: the saving rank first sleeps
this long (rank 0 leaving: its store is gone by then). The saving rank
writes the error it got and how long the save took to ``OUT/saver.json``.
``checkpoint.timeout`` is ``--timeout`` (short: the old code waited it all).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.distributed as dist

import dsrun
from dsrun.runtime.checkpoint import writer


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", required=True, choices=("before", "during"))
    parser.add_argument("--exiter", type=int, default=1)
    parser.add_argument("--sleep", type=float, default=0.0)
    parser.add_argument("--timeout", type=float, default=8.0)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    dsrun.init_distributed()
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    config = {"train_micro_batch_size_per_gpu": 1, "steps_per_print": 1000,
              "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
              "zero_optimization": {"stage": 1}, "checkpoint": {"timeout": args.timeout}}
    engine = dsrun.initialize(model=model, config=config)[0]
    ckpt = os.path.join(args.out, "ckpt")
    engine.save_checkpoint(ckpt, tag="t1")  # type: ignore[attr-defined]
    if rank == args.exiter:
        if args.mode == "before":
            sys.exit(0)
        writer.RankWrite.run = lambda self: sys.exit(0)  # type: ignore[method-assign]
    time.sleep(args.sleep)
    start = time.monotonic()
    try:
        engine.save_checkpoint(ckpt, tag="t2")  # type: ignore[attr-defined]
    except Exception as exc:
        saved(args.out, rank, f"{type(exc).__name__}: {exc}", time.monotonic() - start)
        raise  # the launcher's report reads its error
    saved(args.out, rank, None, time.monotonic() - start)


def saved(out: str, rank: int, error: str | None, seconds: float) -> None:
    with open(os.path.join(out, "saver.json"), "w", encoding="utf-8") as f:
        json.dump({"rank": rank, "error": error, "seconds": seconds}, f)

if __name__ == "__main__":
    main()
