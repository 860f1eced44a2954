"""Real processes: what --max_restarts says about each failed attempt, what
it does not restart, and --timeout as a deadline for the whole job."""

from __future__ import annotations

import time

import pytest

from tests.conftest import WORKERS, run_dsrun

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


def test_the_timeout_is_for_the_whole_job_across_restarts():
    """each attempt got its own --timeout."""
    start = time.monotonic()
    res = run_dsrun("--max_restarts", "3", "--timeout", "6",
                    *_job(ATTEMPTS, "--mode", "fail_then_hang", "--fail_after", "4"))
    took = time.monotonic() - start
    assert res.returncode == 124, res.stderr
    assert res.stderr.count("restarting (") == 1
    assert ("job timed out after 6s (--timeout, counted from the first of 2 attempts): "
            "2 rank(s) still running") in res.stderr, res.stderr
    assert took < 9.5, took  # per attempt it was at least 4 + 6 s
