"""A DeepSpeed tutorial-style script: reads args.local_rank, nothing else."""

import argparse
import os

parser = argparse.ArgumentParser()
parser.add_argument("--local_rank", type=int, default=-1,
                    help="local rank passed from distributed launcher")
parser.add_argument("--epochs", type=int, default=1)
args = parser.parse_args()
print(f"local_rank {args.local_rank} env {os.environ['LOCAL_RANK']} epochs {args.epochs}",
      flush=True)
