"""A script started without dsrun's launcher (mpirun, srun): it calls
dsrun.init_distributed() itself, then checks an all_reduce."""

import torch
import torch.distributed as dist

import dsrun

dsrun.init_distributed()
rank, world = dist.get_rank(), dist.get_world_size()
t = torch.tensor([float(rank + 1)])
dist.all_reduce(t)
source = dsrun.DistEnv.detect().source
print(f"rank {rank}/{world} from {source} sum {t.item():g}", flush=True)
if t.item() != world * (world + 1) / 2:
    raise SystemExit(f"wrong sum {t.item()}")
