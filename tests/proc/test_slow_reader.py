"""Real processes: a job whose stdout reader is slow or stalls.

dsrun's stderr (its report, its messages) must not wait behind a stdout
backlog; once the job has ended, stdout is waited for only while its
reader takes something (DSRUN_OUTPUT_WAIT); a signal while that backlog
drains drops it and keeps the job's exit code. Local ranks,
--dist_backend none: seconds each.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest

from tests.conftest import ROOT, dsrun_argv, read_pids, wait_gone

pytestmark = pytest.mark.proc

# Ranks 0 and 2 flood stdout until stopped; rank 1 fails after 1 s.
FLOOD_THEN_FAIL = """\
import os, sys, time
rank = os.environ["RANK"]
open(os.path.join(sys.argv[1], "rank" + rank), "w").write(str(os.getpid()))
if rank == "1":
    time.sleep(1.0)
    print("rank 1 failing now", file=sys.stderr, flush=True)
    raise RuntimeError("boom on rank 1")
i = 0
while True:
    sys.stdout.write(f"R{rank} L{i:08d} {'x' * 200}\\n")
    i += 1
"""
# One rank writes LINES lines to stdout and ends well.
FLOOD = """\
import sys
for i in range(int(sys.argv[1])):
    sys.stdout.write(f"L{i:08d} {'y' * 90}\\n")
"""


class Stderr:
    """dsrun's stderr, read by a thread (its stdout is left unread)."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self.lines: list[str] = []
        self._thread = threading.Thread(target=self._read, args=(proc,), daemon=True)
        self._thread.start()

    def _read(self, proc: subprocess.Popen) -> None:
        for line in proc.stderr:
            self.lines.append(line)

    def wait_for(self, text: str, timeout: float) -> bool:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if any(text in line for line in self.lines):
                return True
            time.sleep(0.05)
        return False

    def text(self) -> str:
        self._thread.join(10)
        return "".join(self.lines)


def _start(script: Path, *args: str, world: int, env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen(
        dsrun_argv("--cpu", "--num_gpus", str(world), "--dist_backend", "none",
                   "--kill_grace", "1", str(script), *args),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, **env}, cwd=str(ROOT))


@pytest.fixture
def failing_job(tmp_path, pid_dir):
    script = tmp_path / "flood_then_fail.py"
    script.write_text(FLOOD_THEN_FAIL)
    started: list[subprocess.Popen] = []

    def start(**env: str) -> tuple[subprocess.Popen, Stderr]:
        proc = _start(script, str(pid_dir), world=3, env=env)
        started.append(proc)
        return proc, Stderr(proc)

    yield start
    for proc in started:
        proc.kill()
        proc.wait()
    assert wait_gone(list(read_pids(pid_dir).values()), 10) == []


def test_the_failure_report_reaches_stderr_while_stdout_is_stalled(failing_job):
    proc, err = failing_job()
    # Nobody reads stdout: the report (the job's end) still comes at once.
    assert err.wait_for("dsrun: exit code 1", 30), "".join(err.lines)[-3000:]
    text = "".join(err.lines)
    assert "job failed: rank 1 on host" in text and "RuntimeError: boom on rank 1" in text
    assert proc.poll() is None  # stdout's backlog still waits for its (slow) reader
    out = proc.stdout.read()  # the reader comes back: every queued line, then the exit
    assert proc.wait(timeout=30) == 1
    assert out.count("\n") > 1000 and "dropped" not in err.text()


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_while_the_stalled_stdout_drains_keeps_the_failures_exit_code(
        failing_job, sig):
    proc, err = failing_job()
    assert err.wait_for("dsrun: exit code 1", 30), "".join(err.lines)[-3000:]
    proc.send_signal(sig)
    began = time.monotonic()
    assert proc.wait(timeout=15) == 1  # the failing rank's code, not 128+N
    assert time.monotonic() - began < 5
    text = err.text()
    assert "job failed: rank 1 on host" in text and "RuntimeError: boom on rank 1" in text
    assert f"dsrun: {sig.name} after the job ended: dropped " in text, text[-2000:]
    assert "of output not yet written to stdout" in text


def test_a_slow_reader_that_keeps_reading_gets_every_line(tmp_path):
    count = 12_000  # 1.2 MB at about 0.3 MB/s, with DSRUN_OUTPUT_WAIT=1
    script = tmp_path / "flood.py"
    script.write_text(FLOOD)
    proc = _start(script, str(count), world=1, env={"DSRUN_OUTPUT_WAIT": "1"})
    err = Stderr(proc)
    try:
        chunks = []
        fd = proc.stdout.fileno()
        while chunk := os.read(fd, 16384):
            chunks.append(chunk)
            time.sleep(0.05)
        assert proc.wait(timeout=30) == 0, err.text()[-2000:]
    finally:
        proc.kill()
        proc.wait()
    lines = b"".join(chunks).decode().splitlines()
    assert [line.split("] ", 1)[1][:9] for line in lines] == [f"L{i:08d}" for i in range(count)]
    assert "dropped" not in err.text()


def test_a_reader_that_never_reads_does_not_keep_dsrun_after_the_job(tmp_path):
    script = tmp_path / "flood.py"
    script.write_text(FLOOD)
    proc = _start(script, "40000", world=1, env={"DSRUN_OUTPUT_WAIT": "1"})  # 4 MB
    try:
        err = Stderr(proc)
        assert proc.wait(timeout=30) == 0  # the job's exit code
    finally:
        proc.kill()
        proc.wait()
    text = err.text()
    assert "dsrun: nothing was read from dsrun's stdout for 1s after the job ended " \
           "(DSRUN_OUTPUT_WAIT): dropped " in text, text[-2000:]
    assert "Traceback" not in text and "Fatal Python error" not in text


# Rank 1 ends well at once; rank 0 floods stdout until stopped.
FLOOD_AFTER_PEER = """\
import os, sys
rank = os.environ["RANK"]
open(os.path.join(sys.argv[1], "rank" + rank), "w").write(str(os.getpid()))
i = 0
while rank == "0":
    sys.stdout.write(f"L{i:08d} {'z' * 200}\\n")
    i += 1
"""


def test_a_straggler_held_by_a_stalled_stdout_is_said_to_be(tmp_path, pid_dir):
    script = tmp_path / "flood_after_peer.py"
    script.write_text(FLOOD_AFTER_PEER)
    proc = _start(script, str(pid_dir), world=2, env={"DSRUN_STRAGGLER_INTERVAL": "1"})
    try:
        err = Stderr(proc)
        # Nobody reads stdout: the agents are paused, and the straggler line says so.
        assert err.wait_for("(output paused: dsrun's stdout reader is slow)", 30), \
            "".join(err.lines)[-3000:]
        assert any("still running: rank 0 on" in line for line in err.lines)
    finally:
        proc.kill()
        proc.wait()
    assert wait_gone(list(read_pids(pid_dir).values()), 10) == []
