"""A chatty rank: how fast one rank can print N lines through each launcher.

    .venv/bin/python bench/output_flood.py [--lines 200000] [--runs 5]

One rank prints ``--lines`` lines of 100 bytes and reports the time its
own loop took (on stderr, read back from the launcher's output); the
launcher's stdout goes to a pipe drained at full speed. Rows: dsrun,
torchrun (its workers write straight into the inherited descriptor), and
plain python into a pipe (``PYTHONUNBUFFERED=1``, as dsrun and torchrun
set it): the floor. Runs interleave; medians and the ratio to plain python
are printed, with the peak RSS of the largest process of each command's
tree that was waited for (``wait4``: the launcher, its agents, the rank).
"""

from __future__ import annotations

import argparse
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

BIN = Path(sys.executable).parent
RANK = (
    "import sys, time\n"
    "n = int(sys.argv[1])\n"
    "t = time.perf_counter()\n"
    "for i in range(n):\n"
    "    print(f'{i:09d} ' + 'x' * 89)\n"
    "sys.stdout.flush()\n"
    "print(f'RANKTIME {time.perf_counter() - t:.4f}', file=sys.stderr, flush=True)\n")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def commands(script: str, lines: int) -> dict[str, list[str]]:
    return {
        "dsrun": [str(BIN / "dsrun"), "--cpu", "--num_gpus", "1", "--dist_backend", "none",
                  script, str(lines)],
        "torchrun": [str(BIN / "torchrun"), "--nproc_per_node", "1", "--master_port",
                     str(free_port()), script, str(lines)],
        "python | pipe": [sys.executable, script, str(lines)],
    }


def run_once(argv: list[str]) -> tuple[float, float]:
    """(the rank's own loop time, the launcher's peak RSS in MiB)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    assert proc.stdout is not None and proc.stderr is not None
    while proc.stdout.read(1 << 20):
        pass
    err = proc.stderr.read().decode(errors="replace")
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    found = re.search(r"RANKTIME ([0-9.]+)", err)
    if proc.returncode != 0 or found is None:
        raise SystemExit(f"{argv} failed ({proc.returncode}):\n{err[-2000:]}")
    return float(found.group(1)), usage.ru_maxrss / 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lines", type=int, default=200_000)
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        script = os.path.join(tmp, "chatty.py")
        Path(script).write_text(RANK)
        names = list(commands(script, args.lines))
        times: dict[str, list[float]] = {n: [] for n in names}
        rss: dict[str, list[float]] = {n: [] for n in names}
        for i in range(args.runs):
            for name in names[i % len(names):] + names[:i % len(names)]:
                took, peak = run_once(commands(script, args.lines)[name])
                times[name].append(took)
                rss[name].append(peak)
    floor = statistics.median(times["python | pipe"])
    print(f"{args.lines} lines of 100 bytes, one rank, {args.runs} interleaved runs")
    print(f"{'launcher':<16}{'rank s':>8}{'vs python':>11}{'min s':>8}{'max s':>8}"
          f"{'peak RSS MiB':>14}")
    for name in names:
        med = statistics.median(times[name])
        print(f"{name:<16}{med:>8.2f}{med / floor:>10.2f}x{min(times[name]):>8.2f}"
              f"{max(times[name]):>8.2f}{statistics.median(rss[name]):>14.0f}")
    print("(peak RSS: the largest process of the command's tree, from wait4)")


if __name__ == "__main__":
    main()
