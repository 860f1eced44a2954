"""A rank that prints torchrun's restart variables and dsrun's, for the
restart report tests (no torch). Rank 1 exits 4 on every attempt before
--fail_until (DSRUN_RESTART_COUNT counts attempts from 0)."""

import argparse
import os
import sys

p = argparse.ArgumentParser()
p.add_argument("--fail_until", type=int, default=1)
args = p.parse_args()
attempt = int(os.environ["DSRUN_RESTART_COUNT"])
names = ("TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS")
print(f"attempt {attempt}: " + " ".join(f"{n}={os.environ.get(n, '<unset>')}" for n in names),
      flush=True)
if os.environ["RANK"] == "1" and attempt < args.fail_until:
    sys.exit(4)
