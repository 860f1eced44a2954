"""Rank ``--die_rank`` dies without a Python exception (``--how``: exit =
``os._exit(3)``, segv, kill = SIGKILL to itself) while the other ranks wait
for it in a gloo all_reduce: their collective fails with a peer reset, as
a consequence. The report must blame the dead rank and exit with its code.
"""

import argparse
import os
import signal
import time

import torch
import torch.distributed as dist

p = argparse.ArgumentParser()
p.add_argument("--die_rank", type=int, default=1)
p.add_argument("--how", choices=["exit", "segv", "kill"], default="exit")
p.add_argument("--delay", type=float, default=0.5)
p.add_argument("--pid_dir")
args = p.parse_args()

rank = dist.get_rank()
if args.pid_dir:
    with open(os.path.join(args.pid_dir, f"rank_{rank}.pid"), "w") as f:
        f.write(str(os.getpid()))
t = torch.ones(4)
dist.all_reduce(t)  # every rank is connected before one dies
print(f"rank {rank} connected", flush=True)
if rank == args.die_rank:
    time.sleep(args.delay)  # the others are inside the next all_reduce by now
    if args.how == "exit":
        os._exit(3)
    os.kill(os.getpid(), signal.SIGSEGV if args.how == "segv" else signal.SIGKILL)
dist.all_reduce(t)
time.sleep(60)
