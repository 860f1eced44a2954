"""Rank-0-only printing with torch.distributed at the very top of a script.

Under dsrun the process group exists before this file runs, so no setup
code is needed: `dsrun --num_gpus 3 examples/rank0_print.py`.
"""

import torch.distributed as dist

rank = dist.get_rank()
world = dist.get_world_size()

if rank == 0:
    print(f"hello from rank 0 of {world}: only rank 0 prints this line")
dist.barrier()
print(f"every rank prints this: rank {rank}")
