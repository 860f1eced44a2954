"""A torchrun-style script that hard-codes NCCL, run on CPU ranks: its
init_process_group(backend="nccl") is refused with dsrun's error before
dsrun's gloo group is touched (the group still works after it), and
deepspeed.init_distributed(dist_backend="nccl") keeps that group, as
DeepSpeed does. With --raise the refusal is left to end the rank."""

import sys

import deepspeed
import torch
import torch.distributed as dist

from dsrun.errors import DsrunError

if "--raise" in sys.argv:
    dist.init_process_group(backend="nccl")
try:
    dist.init_process_group(backend="nccl")
except DsrunError as exc:
    print(f"refused: {exc}", flush=True)
deepspeed.init_distributed(dist_backend="nccl")
t = torch.ones(1)
dist.all_reduce(t)
print(f"rank {dist.get_rank()} backend {dist.get_backend()} sum {t.item():g}", flush=True)
