"""A rank with signal handlers of its own, for the signal tests (no torch).

--stop SIG: a preemption handler - SIG sets a flag; the main loop then
"saves" for --save seconds, writes OUT/saved_RANK and exits 0.
--usr: SIGUSR1 and SIGUSR2 append a line to OUT/usr_RANK (the job goes on);
with --until_usr the rank exits 0 once it has been there --settle seconds.
--ignore_int: SIGINT is ignored. --stack ignore|block|handle: the stack
signal (SIGRTMIN+4) is ignored, blocked in every thread, or taken over by a
handler of the script's. Without a flag the rank
exits 0 after --run seconds. Every rank writes its pid to --pid_dir.
"""

import argparse
import os
import signal
import sys
import time

p = argparse.ArgumentParser()
p.add_argument("--pid_dir", required=True)
p.add_argument("--out", required=True)
p.add_argument("--stop", action="append", default=[])
p.add_argument("--save", type=float, default=1.0)
p.add_argument("--usr", action="store_true")
p.add_argument("--until_usr", action="store_true")
p.add_argument("--settle", type=float, default=1.0)
p.add_argument("--ignore_int", action="store_true")
p.add_argument("--stack", choices=["ignore", "block", "handle"])
p.add_argument("--run", type=float, default=60.0)
args = p.parse_args()
rank = int(os.environ["RANK"])
flag: list[str] = []


def on_stop(signum: int, frame: object) -> None:
    flag.append(signal.Signals(signum).name)


def on_usr(signum: int, frame: object) -> None:
    with open(os.path.join(args.out, f"usr_{rank}"), "a") as f:
        f.write(f"{signal.Signals(signum).name}\n")


for name in args.stop:
    signal.signal(getattr(signal, name), on_stop)
if args.usr:
    signal.signal(signal.SIGUSR1, on_usr)
    signal.signal(signal.SIGUSR2, on_usr)
if args.ignore_int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
if args.stack == "ignore":
    signal.signal(signal.SIGRTMIN + 4, signal.SIG_IGN)
elif args.stack == "block":
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGRTMIN + 4})
elif args.stack == "handle":
    signal.signal(signal.SIGRTMIN + 4, lambda signum, frame: None)
with open(os.path.join(args.pid_dir, f"rank_{rank}.pid"), "w") as f:
    f.write(str(os.getpid()))
print(f"rank {rank} ready", flush=True)

usr_file = os.path.join(args.out, f"usr_{rank}")
end = time.monotonic() + args.run
usr_seen: float | None = None
while time.monotonic() < end:
    time.sleep(0.05)
    if flag:
        print(f"rank {rank} got {flag[0]}: saving", flush=True)
        time.sleep(args.save)
        with open(os.path.join(args.out, f"saved_{rank}"), "w") as f:
            f.write(flag[0])
        print(f"rank {rank} saved", flush=True)
        sys.exit(0)
    if args.until_usr and os.path.exists(usr_file):
        usr_seen = usr_seen or time.monotonic()
        if time.monotonic() - usr_seen >= args.settle:  # a second copy would have come
            print(f"rank {rank} done after its SIGUSR1", flush=True)
            sys.exit(0)
sys.exit(0 if not args.until_usr else 3)
