"""Two-rank asynchronous saves that fail, for tests/proc/test_checkpoint_async_exit.py.

Every mode trains one step at ZeRO stage 2 and saves tag ``b`` into CKPT
asynchronously (``checkpoint.timeout`` 10 s):

``--mode write-fails-at-exit``: rank 1's data file hits a file-size limit
(RLIMIT_FSIZE, SIGXFSZ ignored) and the script ends without waiting.
``--mode commit-fails-at-exit``: rank 0's rename of ``b.tmp/`` fails and the
script ends without waiting.
``--mode save-dir-vanishes``: the save directory is removed just before
rank 0's rename; every rank waits for the save and writes the error it got
and how long the wait took to ``OUT/rank<R>.json``.
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import resource
import shutil
import signal
import time

import torch
import torch.distributed as dist

import dsrun
from dsrun.errors import CheckpointError
from dsrun.runtime.checkpoint import writer


def build() -> object:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 64), torch.nn.Tanh(), torch.nn.Linear(64, 4))
    config = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 1000,
              "optimizer": {"type": "AdamW", "params": {"lr": 0.01}},
              "zero_optimization": {"stage": 2},
              "checkpoint": {"async": True, "timeout": 10}}
    engine = dsrun.initialize(model=model, config=config)[0]
    loss = engine(torch.randn(2, 8)).square().mean()  # type: ignore[operator]
    engine.backward(loss)  # type: ignore[attr-defined]
    engine.step()  # type: ignore[attr-defined]
    return engine


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", required=True, choices=(
        "write-fails-at-exit", "commit-fails-at-exit", "save-dir-vanishes"))
    parser.add_argument("--out", required=True)
    parser.add_argument("--ckpt", required=True)
    args = parser.parse_args()
    dsrun.init_distributed()
    rank = dist.get_rank()
    engine = build()
    real = writer.replace_dir
    if args.mode == "write-fails-at-exit" and rank == 1:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (2000, resource.RLIM_INFINITY))
    elif args.mode == "commit-fails-at-exit" and rank == 0:
        def broken(tmp: str, final: str) -> None:
            raise OSError(errno.EIO, "injected rename failure")

        writer.replace_dir = broken
    elif args.mode == "save-dir-vanishes" and rank == 0:
        def vanish(tmp: str, final: str) -> None:
            shutil.rmtree(os.path.dirname(tmp))
            real(tmp, final)

        writer.replace_dir = vanish
    engine.save_checkpoint(args.ckpt, tag="b")  # type: ignore[attr-defined]
    print(f"rank {rank}: script done", flush=True)
    if args.mode != "save-dir-vanishes":
        return
    start, text = time.monotonic(), None
    try:
        engine.wait_for_checkpoint()  # type: ignore[attr-defined]
    except CheckpointError as exc:
        text = str(exc)
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
        json.dump({"error": text, "seconds": time.monotonic() - start}, f)


if __name__ == "__main__":
    main()
