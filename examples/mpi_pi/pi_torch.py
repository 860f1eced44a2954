"""Monte-Carlo pi with torch.distributed: every rank counts, one all_reduce sums.

Runs under every dsrun launcher, and started any other way too:

    dsrun --num_gpus 2 examples/mpi_pi/pi_torch.py
    dsrun --launcher openmpi --num_gpus 2 examples/mpi_pi/pi_torch.py
    dsrun --launcher slurm --slurm_args "--time=5" --num_nodes 2 examples/mpi_pi/pi_torch.py
    mpirun -np 2 python examples/mpi_pi/pi_torch.py      # dsrun.init_distributed() finds MPI
    python examples/mpi_pi/pi_torch.py                     # one rank

Each rank draws its share of the samples on one thread (``--threads``), so
the number of ranks is the parallelism; rank 0 prints pi, its error and the
compute time (the slowest rank's).
"""

from __future__ import annotations

import argparse
import math
import time

import torch
import torch.distributed as dist

import dsrun

CHUNK = 1 << 21


def count_hits(samples: int, seed: int, rank: int) -> int:
    gen = torch.Generator().manual_seed(seed * 1_000_003 + rank)
    hits = 0
    left = samples
    while left > 0:
        n = min(left, CHUNK)
        xy = torch.rand(2, n, generator=gen, dtype=torch.float64)
        hits += int(((xy[0] * xy[0] + xy[1] * xy[1]) <= 1.0).sum())
        left -= n
    return hits


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=20_000_000)
    parser.add_argument("--seed", type=int, default=2024)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    dsrun.init_distributed()  # a no-op under dsrun: its runtime did it
    rank, world = dist.get_rank(), dist.get_world_size()
    mine = args.samples // world + (1 if rank < args.samples % world else 0)
    dist.barrier()
    start = time.perf_counter()
    hits = torch.tensor([count_hits(mine, args.seed, rank)], dtype=torch.int64)
    seconds = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
    dist.all_reduce(hits)
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
    if rank == 0:
        pi = 4.0 * int(hits.item()) / args.samples
        print(f"pi ~ {pi:.10f}, error {abs(pi - math.pi):.3e} ({args.samples} samples, "
              f"{world} rank(s), compute {seconds.item():.3f} s)", flush=True)


if __name__ == "__main__":
    main()
