"""Every rank contributes rank+1; the sum must be n(n+1)/2 everywhere."""

import torch
import torch.distributed as dist

rank, world = dist.get_rank(), dist.get_world_size()  # no setup: dsrun did it
t = torch.tensor([float(rank + 1)])
dist.all_reduce(t)
expected = world * (world + 1) / 2
print(f"rank {rank}/{world} backend {dist.get_backend()} sum {t.item():g}", flush=True)
if t.item() != expected:
    raise SystemExit(f"wrong sum {t.item()} != {expected}")
