"""init_process_group(timeout=3 s) from the script: a barrier that rank 1
never joins must time out on rank 0 after about 3 s, not gloo's 30 min."""

import datetime
import os
import sys
import time

import torch.distributed as dist

dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=3))
rank = dist.get_rank()
if rank == 1:
    time.sleep(30)
    sys.exit(0)
start = time.monotonic()
try:
    dist.barrier()
except Exception as exc:  # noqa: BLE001
    took = time.monotonic() - start
    kind = "TIMEOUT" if "timed out" in str(exc).lower() or "timeout" in str(exc).lower() \
        else "ERROR"
    print(f"{kind} after {took:.1f}s: {str(exc).splitlines()[0][:120]}", flush=True)
    os._exit(5)
print("barrier passed", flush=True)
