"""Real processes: what --max_restarts says about each failed attempt, what
it does not restart, and --timeout as a deadline for the whole job."""

from __future__ import annotations

import threading
import time
from typing import IO

import pytest

from tests.conftest import WORKERS, run_dsrun, start_dsrun

pytestmark = pytest.mark.proc
ATTEMPTS = str(WORKERS / "attempts.py")


def _job(*extra: str) -> list[str]:
    return ["--cpu", "--num_gpus", "2", "--dist_backend", "none", "--kill_grace", "1", *extra]


def test_a_restarted_attempts_dsrun_error_is_on_the_terminal_and_in_the_log(tmp_path):
    """a dsrun error is only recorded (the report shows it
    once), so an attempt that was restarted lost it everywhere."""
    logs = tmp_path / "logs"
    res = run_dsrun("--max_restarts", "1", "--log_dir", str(logs),
                    *_job(ATTEMPTS, "--mode", "dsrun_error"))
    assert res.returncode == 0, res.stderr
    message = "CheckpointError: no checkpoint 'nosuchtag' in ck (attempt 0)"
    assert (f"attempt 1 failed (exit code 1 on rank 1): {message}; restarting (1/1)"
            in res.stderr), res.stderr
    log = (logs / "rank_1.log").read_text()
    assert f"# dsrun: rank 1 failed: {message}" in log
    assert "attempts.py:" in log  # the script's line that called dsrun
    assert log.index("rank 1 attempt 0") < log.index(message) < log.index("rank 1 attempt 1")


def test_a_configuration_error_is_not_restarted():
    res = run_dsrun("--max_restarts", "3", *_job(ATTEMPTS, "--mode", "config_error"))
    assert res.returncode == 1, res.stderr
    assert "not restarting: this error recurs on every attempt" in res.stderr
    assert "restarting (" not in res.stderr and "attempt 1" not in res.stdout
    assert 'DsrunConfigError: unknown key "zero_optimzation" (attempt 0)' in res.stderr


def _timed_lines(stream: IO[str], into: list[tuple[float, str]]) -> None:
    for line in stream:
        into.append((time.monotonic(), line))


def test_the_timeout_is_for_the_whole_job_across_restarts():
    """each attempt got its own --timeout.

    The clock starts at the first rank's first line, not at dsrun's launch,
    so CLI start-up under load does not count; the bound sits between the
    right answer (about 6 s + teardown) and the bug's (5 s + restart + 6 s)."""
    proc = start_dsrun("--max_restarts", "3", "--timeout", "6",
                       *_job(ATTEMPTS, "--mode", "fail_then_hang", "--fail_after", "5"))
    assert proc.stdout is not None and proc.stderr is not None
    lines: list[tuple[float, str]] = []
    reader = threading.Thread(target=_timed_lines, args=(proc.stdout, lines), daemon=True)
    reader.start()
    try:
        stderr = proc.stderr.read()
        rc = proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    ended = time.monotonic()
    reader.join(timeout=10)
    assert rc == 124, stderr
    assert stderr.count("restarting (") == 1
    assert ("job timed out after 6s (--timeout, counted from the first of 2 attempts): "
            "2 rank(s) still running") in stderr, stderr
    first = [t for t, line in lines if " attempt 0" in line]
    assert first, lines
    took = ended - first[0]
    assert took < 10, took  # per attempt it was at least 5 + 6 s
