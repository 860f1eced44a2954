"""Monte-Carlo pi, 1 rank vs 2 ranks, under dsrun's launchers: speedup and efficiency.

    .venv/bin/python bench/mpi_pi.py [--runs 5] [--seconds 5]

The sample count is calibrated so that one rank computes for about
``--seconds`` seconds. Then, interleaved (every configuration once per
round, in rotating order, so machine noise hits all alike), ``--runs``
rounds of:

- ``examples/mpi_pi/pi_torch.py`` (torch, one all_reduce) under dsrun's own
  launcher (``--launcher local``) and under ``--launcher openmpi``, with 1
  and 2 ranks;
- ``examples/mpi_pi/pi.py`` (mpi4py manager spawning 1 or 2 workers) under
  ``--launcher openmpi``.

Every process computes on one thread, so the rank count is the
parallelism. Printed per configuration: median compute seconds (the
slowest rank's, as the script reports it) and median wall seconds of the
whole dsrun command, for 1 and 2 ranks, then speedup = T1/T2 and parallel
efficiency = speedup / 2, from the compute times (wall-time ratios in
brackets), once from the medians and once from each cell's fastest run
(noise from other work or neighbouring VMs only ever slows a run, so the
fastest run is the least disturbed one), then every run's compute time.
The goal here is speedup >= 1.8 (90 %) on 2 cores.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TORCH_PI = str(ROOT / "examples" / "mpi_pi" / "pi_torch.py")
MPI_PI = str(ROOT / "examples" / "mpi_pi" / "pi.py")
DSRUN = [sys.executable, "-m", "dsrun.launcher.cli"]
SECONDS = re.compile(r"compute ([0-9.]+) s")


def configs(samples: int) -> dict[str, list[list[str]]]:
    """name -> [argv for 1 rank, argv for 2 ranks]."""
    torch_args = [TORCH_PI, "--samples", str(samples)]
    out = {
        "torch, dsrun local": [DSRUN + ["--num_gpus", str(n), *torch_args] for n in (1, 2)],
        "torch, dsrun openmpi": [DSRUN + ["--launcher", "openmpi", "--num_gpus", str(n),
                                          *torch_args] for n in (1, 2)],
        "mpi4py Spawn, dsrun openmpi": [
            DSRUN + ["--launcher", "openmpi", "--num_gpus", "1", "--dist_backend", "none",
                     "--launcher_args=--oversubscribe", MPI_PI, "--workers", str(n),
                     "--samples", str(samples)] for n in (1, 2)],
    }
    return out


def run_once(argv: list[str]) -> tuple[float, float]:
    """(compute seconds the job reports, wall seconds)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    start = time.perf_counter()
    res = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=str(ROOT),
                         timeout=600)
    wall = time.perf_counter() - start
    match = SECONDS.search(res.stdout)
    if res.returncode != 0 or match is None:
        raise SystemExit(f"{' '.join(argv)} failed ({res.returncode}):\n{res.stdout}\n"
                         f"{res.stderr}")
    return float(match.group(1)), wall


def calibrate(seconds: float) -> int:
    """Samples that take about ``seconds`` on one rank (plain python, one thread)."""
    probe = 10_000_000
    res = subprocess.run([sys.executable, TORCH_PI, "--samples", str(probe)],
                         capture_output=True, text=True, cwd=str(ROOT), timeout=600,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    match = SECONDS.search(res.stdout)
    if match is None:
        raise SystemExit(f"calibration failed:\n{res.stdout}\n{res.stderr}")
    return int(probe * seconds / max(float(match.group(1)), 1e-3))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--samples", type=int, default=None, help="skip calibration")
    args = parser.parse_args()
    samples = args.samples or calibrate(args.seconds)
    jobs = configs(samples)
    cells = [(name, i) for name in jobs for i in (0, 1)]
    results: dict[tuple[str, int], list[tuple[float, float]]] = {c: [] for c in cells}
    for r in range(args.runs):
        shift = r % len(cells)
        for cell in cells[shift:] + cells[:shift]:
            results[cell].append(run_once(jobs[cell[0]][cell[1]]))
    print(f"Monte-Carlo pi, {samples} samples, {args.runs} runs each (load "
          f"{os.getloadavg()[0]:.2f} at the end)")
    for label, pick in (("medians", statistics.median), ("fastest run of each", min)):
        print(f"\n{label}:")
        print(f"{'configuration':<30}{'1 rank s':>10}{'2 ranks s':>11}{'speedup':>9}"
              f"{'efficiency':>12}   wall 1 / 2 ranks")
        for name in jobs:
            c1, w1 = (pick(x) for x in zip(*results[(name, 0)]))
            c2, w2 = (pick(x) for x in zip(*results[(name, 1)]))
            speedup = c1 / c2
            print(f"{name:<30}{c1:>10.2f}{c2:>11.2f}{speedup:>8.2f}x{speedup / 2:>11.0%}   "
                  f"{w1:.2f} / {w2:.2f} s ({w1 / w2:.2f}x)")
    print("\ncompute seconds of every run (spread = machine noise):")
    for cell in cells:
        runs = ", ".join(f"{c:.2f}" for c, _ in results[cell])
        print(f"  {cell[0]}, {cell[1] + 1} rank(s): {runs}")

if __name__ == "__main__":
    main()
