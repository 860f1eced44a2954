"""A job where some ranks finish and the others hang (no torch: --dist_backend none).

Each rank writes its pid to --pid_dir. Ranks in --finish exit 0 at once;
the others sit in ``wait_forever`` (the name tests look for in stacks),
or exit 0 after --sleep seconds when given.
"""

import argparse
import os
import time

p = argparse.ArgumentParser()
p.add_argument("--pid_dir")
p.add_argument("--finish", default="0", help="comma-separated ranks that exit at once")
p.add_argument("--sleep", type=float, default=None)
args = p.parse_args()
rank = int(os.environ["RANK"])
if args.pid_dir:
    with open(os.path.join(args.pid_dir, f"rank_{rank}.pid"), "w") as f:
        f.write(str(os.getpid()))
print(f"rank {rank} up", flush=True)


def wait_forever(limit):
    end = time.monotonic() + (limit if limit is not None else 3600)
    while time.monotonic() < end:
        time.sleep(0.05)


if str(rank) not in args.finish.split(","):
    wait_forever(args.sleep)
print(f"rank {rank} done", flush=True)
