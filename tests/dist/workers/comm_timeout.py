"""Worker for test_comm_timeout: the group dsrun started before the script,
then ``deepspeed.init_distributed(timeout=2 s)`` as a DeepSpeed script calls
it. Rank 1 stays away from the all-reduce; rank 0's must fail after the 2 s,
not wait for rank 1. Writes ``OUT/rankR.json``: the group's timeout before
and after the call (seconds; DEEPSPEED_TIMEOUT is set for the job), and
rank 0's error and how long it waited."""

from __future__ import annotations

import datetime
import json
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

import dsrun as deepspeed
from dsrun import comm


def group_timeout() -> float:
    backend = dist.distributed_c10d._get_default_group()._get_backend(torch.device("cpu"))
    return backend.options._timeout.total_seconds()


def main() -> None:
    out = Path(sys.argv[1])
    fact: dict[str, object] = {"before": group_timeout()}
    deepspeed.init_distributed(dist_backend="gloo", timeout=datetime.timedelta(seconds=2))
    fact["after"] = group_timeout()
    if comm.get_rank() == 0:
        start = time.monotonic()
        try:
            comm.all_reduce(torch.ones(1))
            fact["error"] = None
        except RuntimeError as exc:
            fact["error"] = str(exc)
        fact["waited"] = time.monotonic() - start
    else:
        time.sleep(12)  # far longer than the timeout: rank 0 must not wait for this
    (out / f"rank{comm.get_rank()}.json").write_text(json.dumps(fact))


if __name__ == "__main__":
    main()
