"""Real processes: ranks and readers that behave oddly.

A rank printing dots without a line end is shown while it prints; ranks
the teardown had to SIGKILL are named (a save on Ctrl-C cut off is not
taken for a finished one); a write error on dsrun's stdout other than a
closed pipe is said and exits 1; a signal that stopped the job does not
leave dsrun waiting a minute for a reader that takes nothing; a rank
stopped by SIGSTOP is said to be stopped, and still gets its grace; so
does a stopped process a finished job left behind.
Plain-python ranks, --dist_backend none: a few seconds each.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest

from tests.conftest import ROOT, dsrun_argv, read_pids, wait_for_pids, wait_gone

pytestmark = pytest.mark.proc


def _argv(script: Path, *args: str, world: int = 2, grace: float = 1.0,
          extra: tuple[str, ...] = ()) -> list[str]:
    return dsrun_argv("--cpu", "--num_gpus", str(world), "--dist_backend", "none",
                      "--kill_grace", str(grace), *extra, str(script), *args)


def _env(**more: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "DSRUN_OUTPUT_WAIT"}
    return {**env, **more}


def _script(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


# Rank 0 writes "epoch 1 " and then a dot every 0.1 s for 3 s, no line end.
DOTS = """\
import os, sys, time
if os.environ["RANK"] == "0":
    sys.stdout.write("epoch 1 "); sys.stdout.flush()
    for _ in range(30):
        time.sleep(0.1)
        sys.stdout.write("."); sys.stdout.flush()
    print(" done", flush=True)
"""


def test_dots_without_a_line_end_are_shown_while_they_come(tmp_path):
    proc = subprocess.Popen(_argv(_script(tmp_path, "dots.py", DOTS)), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=_env(), cwd=str(ROOT))
    seen: list[tuple[float, str]] = []
    try:
        for line in proc.stdout:
            seen.append((time.monotonic(), line))
        assert proc.wait(timeout=30) == 0
    finally:
        proc.kill()
        proc.wait()
    pieces = [(t, line.split("] ", 1)[1].rstrip("\n")) for t, line in seen
              if line.startswith("[") and line.split("] ", 1)[0].endswith(":0")]
    assert "".join(text for _, text in pieces) == "epoch 1 " + "." * 30 + " done"
    first, last = pieces[0][0], pieces[-1][0]
    # The first piece came out long before the line ended (3 s of dots).
    assert last - first > 1.5, pieces
    assert len(pieces) >= 4, pieces


# Each rank catches SIGINT and "saves" for SAVE seconds, then says so. The
# pid file is written inside the try: a SIGINT sent once it exists is caught.
SLOW_SAVE = """\
import os, sys, time
rank = os.environ["RANK"]
try:
    open(os.path.join(sys.argv[1], "rank" + rank), "w").write(str(os.getpid()))
    print("rank", rank, "up", flush=True)
    time.sleep(60)
except KeyboardInterrupt:
    print("rank", rank, "saving", flush=True)
    time.sleep(float(sys.argv[2]))
    print("rank", rank, "saved", flush=True)
"""


def _interrupt(tmp_path: Path, pid_dir: Path, save: float,
               grace: float) -> tuple[int, str, str]:
    script = _script(tmp_path, "slow_save.py", SLOW_SAVE)
    proc = subprocess.Popen(_argv(script, str(pid_dir), str(save), grace=grace),
                            stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=_env(), cwd=str(ROOT))
    try:
        wait_for_pids(pid_dir, 2)
        time.sleep(0.3)  # slack: the pid files already say they are in their try blocks
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
        proc.wait()
    assert wait_gone(list(read_pids(pid_dir).values()), 5) == []
    return proc.returncode, out, err


def test_ranks_killed_after_the_grace_of_a_ctrl_c_are_named(tmp_path, pid_dir):
    code, out, err = _interrupt(tmp_path, pid_dir, save=30.0, grace=1.0)
    assert code == 130, err
    assert "rank 0 saving" in out and "saved" not in out
    assert "dsrun: rank 0, 1 on host " in err, err
    assert " still running --kill_grace 1s after SIGINT: killed with SIGKILL (anything they " \
           "still did - a save in except KeyboardInterrupt, finally, atexit - was cut off" in err
    assert "dsrun: stopped by SIGINT; every rank was stopped (2 of them with SIGKILL)" in err


def test_ranks_that_finish_their_save_within_the_grace_are_not_named(tmp_path, pid_dir):
    code, out, err = _interrupt(tmp_path, pid_dir, save=0.1, grace=10.0)
    assert code == 130, err
    assert out.count("saved") == 2
    assert "SIGKILL" not in err, err
    assert err.rstrip().endswith("dsrun: stopped by SIGINT; every rank was stopped")


# Rank 0 ignores SIGTERM in a C sleep; rank 1 fails once rank 0 says (a file
# in argv[2]) that it ignores SIGTERM.
IGNORES_TERM = """\
import ctypes, os, signal, sys, time
rank = os.environ["RANK"]
open(os.path.join(sys.argv[1], "rank" + rank), "w").write(str(os.getpid()))
ready = os.path.join(sys.argv[2], "ignoring")
if rank == "0":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    open(ready, "w").close()
    print("rank 0 ignoring SIGTERM", flush=True)
    ctypes.CDLL(None).sleep(60)
end = time.monotonic() + 50
while not os.path.exists(ready) and time.monotonic() < end:
    time.sleep(0.02)
sys.exit(2)
"""


def test_a_rank_killed_in_a_failures_teardown_is_named_in_the_report(tmp_path, pid_dir):
    script = _script(tmp_path, "ignores_term.py", IGNORES_TERM)
    side = tmp_path / "side"
    side.mkdir()
    res = subprocess.run(_argv(script, str(pid_dir), str(side)), capture_output=True,
                         text=True, env=_env(), cwd=str(ROOT), timeout=90)
    assert (side / "ignoring").exists(), res.stderr
    assert res.returncode == 2, res.stderr
    lines = res.stderr.splitlines()
    assert "dsrun: job failed: rank 1 on host" in res.stderr
    killed = [line for line in lines if "killed with SIGKILL" in line]
    assert len(killed) == 1 and killed[0].startswith("dsrun: rank 0 on host "), res.stderr
    assert "still running --kill_grace 1s after SIGTERM" in killed[0]
    assert lines[-1] == "dsrun: exit code 2"
    assert wait_gone(list(read_pids(pid_dir).values()), 5) == []


# Each rank writes a line every 20 ms for 4 s.
CHATTY = """\
import os, sys, time
rank = os.environ["RANK"]
open(os.path.join(sys.argv[1], "rank" + rank), "w").write(str(os.getpid()))
for i in range(200):
    print("line", i, "x" * 100, flush=True)
    time.sleep(0.02)
"""


def test_a_full_disk_under_stdout_is_said_and_exits_1(tmp_path, pid_dir):
    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full here")
    script = _script(tmp_path, "chatty.py", CHATTY)
    with open("/dev/full", "w") as full:
        res = subprocess.run(_argv(script, str(pid_dir)), stdout=full, stderr=subprocess.PIPE,
                             text=True, env=_env(), cwd=str(ROOT), timeout=30)
    assert res.returncode == 1, res.stderr
    assert res.stderr.splitlines()[-1] == (
        "dsrun: error: cannot write to stdout: [Errno 28] No space left on device: the job "
        "was stopped (its output from there on is lost)"), res.stderr
    assert "Traceback" not in res.stderr and "Exception ignored" not in res.stderr
    assert wait_gone(list(read_pids(pid_dir).values()), 5) == []


# Ranks flood stdout until stopped.
FLOOD = """\
import os, sys
rank = os.environ["RANK"]
open(os.path.join(sys.argv[1], "rank" + rank), "w").write(str(os.getpid()))
i = 0
while True:
    sys.stdout.write(f"R{rank} L{i:08d} {'z' * 100}\\n")
    i += 1
"""


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_does_not_leave_dsrun_waiting_for_a_reader_that_takes_nothing(
        tmp_path, pid_dir, sig):
    script = _script(tmp_path, "flood.py", FLOOD)
    proc = subprocess.Popen(_argv(script, str(pid_dir)), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=_env(), cwd=str(ROOT))
    err: list[str] = []
    reader = threading.Thread(target=lambda: err.extend(proc.stderr), daemon=True)
    reader.start()
    try:
        wait_for_pids(pid_dir, 2)
        time.sleep(1.0)  # stdout's pipe and dsrun's backlog fill: nobody reads them
        proc.send_signal(sig)
        began = time.monotonic()
        code = proc.wait(timeout=20)  # DSRUN_OUTPUT_WAIT's default would be 60 s
        took = time.monotonic() - began
    finally:
        proc.kill()
        proc.wait()
    reader.join(5)
    text = "".join(err)
    assert code == 128 + sig, text[-2000:]
    assert took < 10, took
    assert f"dsrun: nothing was read from dsrun's stdout for 3s after {sig.name} stopped " \
           f"the job (dsrun then waits at most 3s for its reader): dropped " in text, text[-2000:]
    assert wait_gone(list(read_pids(pid_dir).values()), 5) == []


# Rank 1 stops itself with SIGSTOP; on SIGTERM it notes that it got it.
STOPS = """\
import os, signal, sys, time
rank = os.environ["RANK"]
open(os.path.join(sys.argv[1], "rank" + rank), "w").write(str(os.getpid()))

def on_term(signum, frame):
    open(os.path.join(sys.argv[1], "term" + rank), "w").write("x")
    sys.exit(0)

signal.signal(signal.SIGTERM, on_term)
print("rank", rank, "up", flush=True)
if rank == "1":
    os.kill(os.getpid(), signal.SIGSTOP)
time.sleep(60)
"""


def test_a_stopped_rank_is_said_to_be_stopped_and_still_gets_its_sigterm(tmp_path, pid_dir):
    script = _script(tmp_path, "stops.py", STOPS)
    res = subprocess.run(_argv(script, str(pid_dir), grace=5.0, extra=("--timeout", "6")),
                         capture_output=True, text=True, env=_env(), cwd=str(ROOT), timeout=60)
    assert res.returncode == 124, res.stderr
    assert "(no stack: the rank is stopped (SIGSTOP), not running; SIGCONT resumes it)" \
        in res.stderr, res.stderr
    # Continued after its SIGTERM, its handler ran: no SIGKILL was needed.
    assert (pid_dir / "term1").exists() and "SIGKILL" not in res.stderr, res.stderr
    assert wait_gone([int((pid_dir / f"rank{r}").read_text()) for r in (0, 1)], 5) == []


# Rank 0 forks a child that stays in its group, catches SIGTERM and stops
# itself (SIGSTOP); once it is stopped both ranks exit 0, leaving it behind.
LEAVES_A_STOPPED_CHILD = """\
import os, signal, sys, time
side, rank = sys.argv[1], os.environ["RANK"]
if rank == "0":
    child = os.fork()
    if child == 0:
        null = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(null, fd)
        def on_term(signum, frame):
            open(os.path.join(side, "term"), "w").close()
            os._exit(0)
        signal.signal(signal.SIGTERM, on_term)
        os.kill(os.getpid(), signal.SIGSTOP)
        time.sleep(120)
        os._exit(0)
    with open(os.path.join(side, "child.tmp"), "w") as f:
        f.write(str(child))
    os.rename(os.path.join(side, "child.tmp"), os.path.join(side, "child"))
    stat = "/proc/%d/stat" % child
    while open(stat).read().rsplit(")", 1)[1].split()[0] != "T":
        time.sleep(0.01)
"""


def test_a_stopped_leftover_of_a_finished_job_gets_sigcont_after_its_sigterm(tmp_path):
    side = tmp_path / "side"
    side.mkdir()
    script = _script(tmp_path, "leaves.py", LEAVES_A_STOPPED_CHILD)
    began = time.monotonic()
    res = subprocess.run(_argv(script, str(side), grace=30.0), capture_output=True, text=True,
                         env=_env(), cwd=str(ROOT), timeout=90)
    took = time.monotonic() - began
    child = int((side / "child").read_text())
    assert wait_gone([child], 40) == []
    assert res.returncode == 0, res.stderr
    # Continued after the final sweep's SIGTERM, its handler ran at once
    # (without SIGCONT it sits out the 30 s grace and dies of SIGKILL).
    assert (side / "term").exists(), res.stderr
    assert took < 20, (took, res.stderr)
