"""A script written for torchrun: it initialises the process group itself."""

import sys

import torch
import torch.distributed as dist

dist.init_process_group(backend="gloo")  # dsrun already did: must be tolerated
rank = dist.get_rank()
t = torch.ones(1) * rank
dist.all_reduce(t)
print(f"rank {rank} argv {sys.argv[1:]} sum {t.item():g} main {__name__}", flush=True)
if len(sys.argv) > 1 and sys.argv[1] == "--fail" and rank == 1:
    sys.exit(3)
dist.barrier()  # rank 0 waits here when rank 1 fails: dsrun must still stop it
