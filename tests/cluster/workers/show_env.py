"""A rank that shows what it got of some environment variables, then waits.

``--show NAME...`` prints ``NAME=value``; ``--hash NAME...`` prints the
SHA-256 of the value instead (for secrets: the test compares digests, so the
value never appears in any output). Writes ``rank_N`` into ``--ready_dir``
once it has printed, then sleeps ``--sleep`` seconds.
"""

import argparse
import hashlib
import os
import socket
import time

p = argparse.ArgumentParser()
p.add_argument("--show", nargs="*", default=[])
p.add_argument("--hash", nargs="*", default=[])
p.add_argument("--ready_dir")
p.add_argument("--sleep", type=float, default=0.0)
args = p.parse_args()

rank = os.environ["RANK"]
print(f"rank {rank} on {socket.gethostname()}", flush=True)
for name in args.show:
    print(f"{name}={os.environ.get(name, '<unset>')}", flush=True)
for name in args.hash:
    value = os.environ.get(name)
    digest = hashlib.sha256(value.encode()).hexdigest() if value is not None else "<unset>"
    print(f"{name} sha256 {digest}", flush=True)
if args.ready_dir:
    with open(os.path.join(args.ready_dir, f"rank_{rank}"), "w") as f:
        f.write(str(os.getpid()))
time.sleep(args.sleep)
