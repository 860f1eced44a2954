"""A rank that fails of its own on a stop signal, for the preemption tests
(no torch).

On SIGTERM rank --crash_rank "saves" for --after seconds, then does --how:
``raise`` (a traceback, status 1), ``segv`` (dies of SIGSEGV), ``exit3``
(``os._exit(3)``, no record); every
other rank exits 0 at once (a clean save). Every rank writes its pid to
--pid_dir and then waits up to --run seconds.
"""

import argparse
import os
import signal
import sys
import time

p = argparse.ArgumentParser()
p.add_argument("--pid_dir", required=True)
p.add_argument("--how", choices=["raise", "segv", "exit3"], required=True)
p.add_argument("--crash_rank", type=int, default=1)
p.add_argument("--after", type=float, default=0.3)
p.add_argument("--run", type=float, default=60.0)
args = p.parse_args()
rank = int(os.environ["RANK"])


def on_term(signum: int, frame: object) -> None:
    if rank != args.crash_rank:
        sys.exit(0)
    time.sleep(args.after)  # a save under way: the signal has reached everyone by now
    if args.how == "raise":
        raise RuntimeError(f"rank {rank}: the save on SIGTERM broke")
    if args.how == "segv":
        signal.signal(signal.SIGSEGV, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGSEGV)
        time.sleep(5)
    os._exit(3)


signal.signal(signal.SIGTERM, on_term)
with open(os.path.join(args.pid_dir, f"rank_{rank}.pid"), "w") as f:
    f.write(str(os.getpid()))
print(f"rank {rank} ready", flush=True)
end = time.monotonic() + args.run
while time.monotonic() < end:
    time.sleep(0.05)
sys.exit(0)
