"""Counting random points in the quarter circle: the work of every Pi example.

A process's share of the samples and its random stream depend only on the
total, the seed, its index and the number of processes, so a run is
reproducible and the shares never overlap.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

CHUNK = 1 << 21  # samples per step: bounded memory whatever the total


def share(total: int, index: int, count: int) -> int:
    """Samples of process ``index`` out of ``count`` (the first ones get the rest)."""
    return total // count + (1 if index < total % count else 0)


def count_hits(samples: int, seed: int, index: int, count: int) -> int:
    """Points of ``samples`` uniform draws in [0,1)^2 with x^2 + y^2 <= 1."""
    rng = np.random.default_rng(np.random.SeedSequence(seed).spawn(count)[index])
    hits = 0
    left = samples
    while left > 0:
        n = min(left, CHUNK)
        xy = rng.random((2, n))
        hits += int(np.count_nonzero(xy[0] * xy[0] + xy[1] * xy[1] <= 1.0))
        left -= n
    return hits


def wait(request: Any, poll: float = 0.002) -> None:
    """Wait for a non-blocking MPI operation without spinning.

    A blocking MPI call busy-polls a core; with the manager and the workers
    on as many cores as there are workers, a waiting process would take CPU
    from one still computing.
    """
    while not request.Test():
        time.sleep(poll)
