"""A rank that fails differently per attempt, for the --max_restarts tests.

Runs with --dist_backend none (no torch import). ``DSRUN_RESTART_COUNT``
says which attempt this is; every mode succeeds or hangs after the first.
"""

import argparse
import os
import sys
import time

from dsrun.errors import CheckpointError, DsrunConfigError

p = argparse.ArgumentParser()
p.add_argument("--mode", choices=["dsrun_error", "config_error", "fail_then_hang"])
p.add_argument("--fail_after", type=float, default=0.2)
args = p.parse_args()

rank = int(os.environ["RANK"])
attempt = int(os.environ["DSRUN_RESTART_COUNT"])
print(f"rank {rank} attempt {attempt}", flush=True)
if args.mode == "config_error":
    raise DsrunConfigError(f'unknown key "zero_optimzation" (attempt {attempt})')
if attempt == 0 and rank == 1:
    time.sleep(args.fail_after)
    if args.mode == "dsrun_error":
        raise CheckpointError(f"no checkpoint 'nosuchtag' in ck (attempt {attempt})")
    sys.exit(4)
if args.mode == "fail_then_hang":
    time.sleep(60)
