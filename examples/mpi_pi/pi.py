"""Monte-Carlo pi with mpi4py: the manager (manager/worker pattern).

The manager spawns the workers (``cpi.py``) with ``MPI.COMM_SELF.Spawn``,
broadcasts the sample count and seed over the resulting intercommunicator,
reduces the workers' hit counts (and their compute times) and prints pi
and its error. Everyone waits with non-blocking calls and a short sleep
(montecarlo.wait), so that no waiting process busy-polls a core that a
worker still computing needs. Run it as one
MPI process:

    mpirun -np 1 --oversubscribe python examples/mpi_pi/pi.py --workers 2
    dsrun --launcher openmpi --num_gpus 1 --dist_backend none \\
        --launcher_args=--oversubscribe examples/mpi_pi/pi.py --workers 2

(``--oversubscribe``: the workers need MPI slots beyond the manager's; on a
host with fewer cores than workers + 1 Open MPI refuses them otherwise.)
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

import numpy as np
from montecarlo import wait
from mpi4py import MPI


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--samples", type=int, default=20_000_000)
    parser.add_argument("--seed", type=int, default=2024)
    args = parser.parse_args()
    if MPI.COMM_WORLD.Get_size() != 1:
        sys.exit(f"pi.py is the manager: start one process (got {MPI.COMM_WORLD.Get_size()}; "
                 f"with dsrun use --num_gpus 1)")
    if args.workers < 1 or args.samples < 1:
        sys.exit("--workers and --samples must be at least 1")
    worker = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cpi.py")
    start = time.perf_counter()
    comm = MPI.COMM_SELF.Spawn(sys.executable, args=[worker], maxprocs=args.workers)
    params = np.array([args.samples, args.seed], dtype=np.int64)
    comm.Bcast([params, MPI.INT64_T], root=MPI.ROOT)
    hits = np.zeros(1, dtype=np.int64)
    wait(comm.Ireduce(None, [hits, MPI.INT64_T], op=MPI.SUM, root=MPI.ROOT))
    seconds = np.zeros(1, dtype=np.float64)  # the slowest worker's compute time
    wait(comm.Ireduce(None, [seconds, MPI.DOUBLE], op=MPI.MAX, root=MPI.ROOT))
    wait(comm.Ibarrier())
    comm.Disconnect()
    elapsed = time.perf_counter() - start
    pi = 4.0 * int(hits[0]) / args.samples
    print(f"pi ~ {pi:.10f}, error {abs(pi - math.pi):.3e} ({args.samples} samples, "
          f"{args.workers} workers, compute {seconds[0]:.3f} s, {elapsed:.2f} s with the "
          f"spawn)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
