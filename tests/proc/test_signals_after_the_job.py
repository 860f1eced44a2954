"""Signal handling once a job stopped by a signal has ended: a caller of
``launch.run`` in its own program gets its handlers back, while the dsrun
program keeps absorbing the rest of a burst (tests/proc/test_failures.py)
yet exits at once, with 128+signum, on the third signal after the job
ended - also while blocked writing its output to a reader that stopped.
Each case runs in a process of its own (its signal handlers are changed)."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time

from tests.conftest import ROOT, WORKERS, wait_for_pids

IN_PROCESS = """\
import os, signal, sys, threading, time
from dsrun.launcher import launch
from dsrun.launcher.cli import parse_spec

def mine(signum, frame):
    pass

for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
    signal.signal(sig, mine)
pid_dir = sys.argv[1]
spec = parse_spec(["--cpu", "--num_gpus", "1", "--dist_backend", "none", sys.argv[2],
                   "--pid_dir", pid_dir, "--finish", "none"])

def stop_it():
    while not os.listdir(pid_dir):
        time.sleep(0.05)
    time.sleep(0.5)
    os.kill(os.getpid(), signal.SIGINT)

threading.Thread(target=stop_it, daemon=True).start()
code = launch.run(spec)
handlers = [signal.getsignal(s) is mine for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)]
print(code, handlers)
"""


def test_a_caller_of_run_gets_its_handlers_back_after_a_signal_stopped_job(pid_dir):
    res = subprocess.run([sys.executable, "-c", IN_PROCESS, str(pid_dir),
                          str(WORKERS / "hang.py")], capture_output=True, text=True,
                         timeout=60, cwd=str(ROOT))
    assert res.stdout.strip().splitlines()[-1] == "130 [True, True, True]", res.stdout + res.stderr


BLOCKED = """\
import sys
from dsrun.launcher.cli import main

code = main(sys.argv[1:])
for _ in range(200_000):  # nobody reads dsrun's stdout: blocked writing it, line by line
    sys.stdout.write("x" * 99 + "\\n")
sys.exit(code)
"""


def test_dsrun_blocked_writing_after_the_job_exits_on_the_third_signal(pid_dir):
    proc = subprocess.Popen(
        [sys.executable, "-c", BLOCKED, "--cpu", "--num_gpus", "1", "--dist_backend", "none",
         str(WORKERS / "hang.py"), "--pid_dir", str(pid_dir), "--finish", "none"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=str(ROOT))
    err: list[str] = []
    reader = threading.Thread(target=lambda: err.extend(proc.stderr), daemon=True)
    reader.start()
    try:
        wait_for_pids(pid_dir, 1)
        proc.send_signal(signal.SIGINT)  # stops the job
        end = time.monotonic() + 20
        while not any("stopped by SIGINT" in line for line in err) and time.monotonic() < end:
            time.sleep(0.05)
        time.sleep(1.0)  # the job is over; dsrun is blocked writing to its stdout
        assert proc.poll() is None, "".join(err)
        for _ in range(3):
            proc.send_signal(signal.SIGINT)
            time.sleep(0.3)
        code = proc.wait(timeout=5)
    finally:
        proc.kill()
        proc.wait()
        reader.join(5)
    assert code == 128 + signal.SIGINT, "".join(err)
    assert any("SIGINT again after the job ended: exiting now" in line for line in err), \
        "".join(err)
