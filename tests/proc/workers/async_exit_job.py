"""Two-rank asynchronous saves that fail, for tests/proc/test_checkpoint_async_exit.py.

Every mode trains one step at ZeRO stage 2 and saves tag ``b`` into CKPT
asynchronously (``checkpoint.timeout`` 10 s):

``--mode write-fails-at-exit``: rank 1's data file hits a file-size limit
(RLIMIT_FSIZE, SIGXFSZ ignored; its writes wait for the test's pause mark
of rank 0, when one is set) and the script ends without waiting.
``--mode commit-fails-at-exit``: rank 0's rename of ``b.tmp/`` fails and the
script ends without waiting.
``--mode save-dir-vanishes``: the save directory is removed just before
rank 0's rename; every rank waits for the save and writes the error it got
and how long the wait took to ``OUT/rank<R>.json``.
``--mode write-fails-early``: as ``write-fails-at-exit``, but both scripts
go on for a second after the save (rank ``--slow`` 1.5 s more) and print
``rank R: script done`` at their very end: the save fails while they run.
``--mode straggler``: the script ends without waiting; the test pauses
rank 1 before it writes (``DSRUN_CHECKPOINT_TEST_PAUSE=1:stage``) until
rank 0 has given it up (``--timeout`` seconds) and removed ``b.tmp/``.
``--mode many-saves``: six saves (tags ``s0``..``s5``), each waited for;
rank 1's write of every odd one fails (an injected ENOSPC). Rank 0 writes
the number of keys in the job's store after each to ``OUT/keys.json``.
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
from typing import Any

import torch
import torch.distributed as dist

import dsrun
from dsrun.errors import CheckpointError
from dsrun.runtime.checkpoint import storage, writer


def build(timeout: float) -> object:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 64), torch.nn.Tanh(), torch.nn.Linear(64, 4))
    config = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 1000,
              "optimizer": {"type": "AdamW", "params": {"lr": 0.01}},
              "zero_optimization": {"stage": 2},
              "checkpoint": {"async": True, "timeout": timeout}}
    engine = dsrun.initialize(model=model, config=config)[0]
    loss = engine(torch.randn(2, 8)).square().mean()  # type: ignore[operator]
    engine.backward(loss)  # type: ignore[attr-defined]
    engine.step()  # type: ignore[attr-defined]
    return engine


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", required=True, choices=(
        "write-fails-at-exit", "commit-fails-at-exit", "save-dir-vanishes",
        "write-fails-early", "straggler", "many-saves"))
    parser.add_argument("--out", required=True)
    parser.add_argument("--ckpt", required=True)
    parser.add_argument("--timeout", type=float, default=10.0)
    parser.add_argument("--slow", type=int, default=0)
    args = parser.parse_args()
    dsrun.init_distributed()
    rank = dist.get_rank()
    engine = build(args.timeout)
    if args.mode == "many-saves":
        many_saves(engine, rank, args)
        return
    real = writer.replace_dir
    if args.mode in ("write-fails-at-exit", "write-fails-early") and rank == 1:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (2000, resource.RLIM_INFINITY))
        if args.mode == "write-fails-at-exit":
            after_rank0_paused()
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
    if args.mode == "write-fails-early":
        time.sleep(1.0 + (1.5 if rank == args.slow else 0.0))
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


def after_rank0_paused() -> None:
    """Rank 1 writes (and fails) only once rank 0 is held at its pause
    point (the test's mark file): else, on a loaded machine, rank 1's
    failure can stop rank 0's save before rank 0 reaches the pause."""
    mark, real = os.environ.get("DSRUN_CHECKPOINT_TEST_PAUSE_MARK"), storage.write_all
    if not mark:
        return

    def write_all(fd: int, data: memoryview) -> None:
        end = time.monotonic() + 60
        while not os.path.exists(mark) and time.monotonic() < end:
            time.sleep(0.02)
        real(fd, data)

    storage.write_all = write_all


def many_saves(engine: Any, rank: int, args: argparse.Namespace) -> None:
    real = storage.write_all
    failing = [False]

    def write_all(fd: int, data: memoryview) -> None:
        if failing[0]:
            raise storage.WriteFailed(OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)), 0)
        real(fd, data)

    storage.write_all = write_all
    store = dist.distributed_c10d._get_default_store()
    keys = []
    for i in range(6):
        failing[0] = rank == 1 and i % 2 == 1
        engine.save_checkpoint(args.ckpt, tag=f"s{i}")
        try:
            engine.wait_for_checkpoint()
        except CheckpointError:
            assert i % 2 == 1, f"save s{i} failed"
        else:
            assert i % 2 == 0, f"save s{i} did not fail"
        dist.barrier()  # every rank is done with the save's keys (and its agreements')
        keys.append(store.num_keys())
        dist.barrier()  # ... and rank 1 posts nothing of the next save before rank 0 counted
    if rank == 0:
        with open(os.path.join(args.out, "keys.json"), "w") as f:
            json.dump(keys, f)


if __name__ == "__main__":
    main()
