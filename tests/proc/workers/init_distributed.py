"""A script started without dsrun's launcher (mpirun, srun): it calls
dsrun.init_distributed() itself, then checks an all_reduce."""

import os

import torch
import torch.distributed as dist

import dsrun

source = dsrun.DistEnv.detect().source  # before init_distributed exports RANK and the rest
dsrun.init_distributed()
rank, world = dist.get_rank(), dist.get_world_size()
t = torch.tensor([float(rank + 1)])
dist.all_reduce(t)
# one write per line: with unbuffered output print() writes the newline
# separately, and mpirun may interleave the two ranks' lines between them
os.write(1, f"rank {rank}/{world} from {source} sum {t.item():g}\n".encode())
# what init_distributed exported, as DeepSpeed's does (RANK ... MASTER_PORT)
names = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
os.write(1, (f"rank {rank} environ "
             + " ".join(f"{n}={os.environ.get(n)}" for n in names) + "\n").encode())
if t.item() != world * (world + 1) / 2:
    raise SystemExit(f"wrong sum {t.item()}")
