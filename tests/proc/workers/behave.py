"""A rank that misbehaves on request, for the launcher's process tests.

Runs under dsrun with --dist_backend none (no torch import: fast). Every
process it creates writes its pid to --pid_dir so tests can check that all
of them are gone afterwards.
"""

import argparse
import os
import signal
import subprocess
import sys
import time

p = argparse.ArgumentParser()
p.add_argument("--pid_dir")
p.add_argument("--fail_rank", type=int)
p.add_argument("--code", type=int, default=3)
p.add_argument("--delay", type=float, default=0.3)
p.add_argument("--segv_rank", type=int)
p.add_argument("--raise_rank", type=int)
p.add_argument("--ignore_term_rank", type=int)
p.add_argument("--grandchild", choices=["group", "setsid"])
p.add_argument("--flaky", action="store_true", help="fail on the first attempt only")
p.add_argument("--sleep", type=float, default=60.0)
args = p.parse_args()

rank = int(os.environ["RANK"])


def note(name: str, pid: int) -> None:
    if args.pid_dir:
        with open(os.path.join(args.pid_dir, name), "w") as f:
            f.write(str(pid))


if args.ignore_term_rank == rank:  # ignores what a stop sends first (SIGINT for a Ctrl-C)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
if args.grandchild:
    code = "import signal,time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(120)"
    child = subprocess.Popen([sys.executable, "-c", code],
                             start_new_session=args.grandchild == "setsid")
    note(f"grandchild_{rank}.pid", child.pid)
note(f"rank_{rank}.pid", os.getpid())
print(f"rank {rank} up", flush=True)

if args.flaky:
    attempt = int(os.environ["DSRUN_RESTART_COUNT"])
    print(f"rank {rank} attempt {attempt}", flush=True)
    if attempt == 0 and rank == 1:
        time.sleep(args.delay)
        sys.exit(4)
    sys.exit(0)
if args.fail_rank == rank:
    time.sleep(args.delay)
    print(f"rank {rank} exiting with {args.code}", flush=True)
    sys.exit(args.code)
if args.segv_rank == rank:
    time.sleep(args.delay)
    os.kill(os.getpid(), signal.SIGSEGV)
if args.raise_rank == rank:
    time.sleep(args.delay)
    raise ValueError(f"deliberate failure on rank {rank}")
time.sleep(args.sleep)
