"""Monte-Carlo pi with mpi4py: a worker, spawned by pi.py (the manager).

It receives the sample count and seed by a broadcast from the manager,
counts its share of the points in the quarter circle, and sends the count
back in a sum reduction (and its compute time in a max reduction).
"""

from __future__ import annotations

import time

import numpy as np
from montecarlo import count_hits, share, wait
from mpi4py import MPI

comm = MPI.Comm.Get_parent()
size, rank = comm.Get_size(), comm.Get_rank()
params = np.zeros(2, dtype=np.int64)
comm.Bcast([params, MPI.INT64_T], root=0)
samples, seed = int(params[0]), int(params[1])
start = time.perf_counter()
hits = np.array([count_hits(share(samples, rank, size), seed, rank, size)], dtype=np.int64)
seconds = np.array([time.perf_counter() - start])
wait(comm.Ireduce([hits, MPI.INT64_T], None, op=MPI.SUM, root=0))
wait(comm.Ireduce([seconds, MPI.DOUBLE], None, op=MPI.MAX, root=0))
wait(comm.Ibarrier())
comm.Disconnect()
