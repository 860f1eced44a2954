"""Wall time of a trivial 2-rank gloo job: dsrun vs torchrun vs plain python.

    .venv/bin/python bench/launch_overhead.py [--runs 7]

Each round runs every launcher once, in rotating order (interleaved, so
machine noise hits all alike); medians and the dsrun/torchrun ratio are
printed. Plain python runs one rank (the floor: one torch import + init).
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
JOB = str(HERE / "trivial_job.py")
BIN = Path(sys.executable).parent

COMMANDS = {
    "dsrun": [str(BIN / "dsrun"), "--num_gpus", "2", JOB],
    "torchrun": [str(BIN / "torchrun"), "--nproc_per_node", "2", "--master_port", "{port}", JOB],
    "python (1 rank)": [sys.executable, JOB],
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def time_once(argv: list[str]) -> float:
    argv = [a.format(port=free_port()) for a in argv]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    start = time.perf_counter()
    res = subprocess.run(argv, capture_output=True, text=True, env=env)
    elapsed = time.perf_counter() - start
    if res.returncode != 0:
        raise SystemExit(f"{argv} failed ({res.returncode}):\n{res.stderr}")
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=7)
    args = parser.parse_args()
    names = list(COMMANDS)
    times: dict[str, list[float]] = {n: [] for n in names}
    for i in range(args.runs):
        order = names[i % len(names):] + names[:i % len(names)]
        for name in order:
            times[name].append(time_once(COMMANDS[name]))
    med = {n: statistics.median(t) for n, t in times.items()}
    print(f"{'launcher':<18}{'median s':>10}{'min s':>8}{'max s':>8}   ({args.runs} runs each)")
    for name in names:
        print(f"{name:<18}{med[name]:>10.2f}{min(times[name]):>8.2f}{max(times[name]):>8.2f}")
    print(f"dsrun / torchrun = {med['dsrun'] / med['torchrun']:.2f}  (goal <= 0.70)")


if __name__ == "__main__":
    main()
