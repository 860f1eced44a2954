"""Real processes: a second job given the --log_dir a running job writes is
refused before any of its ranks starts, naming the running job, which goes
on undisturbed (one rank each, --dist_backend none)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.conftest import run_dsrun, start_dsrun

pytestmark = pytest.mark.proc
ONE = ["--cpu", "--num_gpus", "1", "--dist_backend", "none"]


def test_a_second_job_on_a_running_jobs_log_dir_is_refused(tmp_path: Path):
    go, logs = tmp_path / "go", tmp_path / "logs"
    script = tmp_path / "wait.py"
    script.write_text("import os, sys, time\n"
                      "print('first job up', flush=True)\n"
                      "deadline = time.time() + 30\n"
                      f"while not os.path.exists({str(go)!r}) and time.time() < deadline:\n"
                      "    time.sleep(0.02)\n"
                      "print('first job done')\n")
    first = start_dsrun(*ONE, "--log_dir", str(logs), str(script))
    try:
        log = logs / "rank_0.log"
        deadline = time.monotonic() + 30
        while "first job up" not in (log.read_text() if log.exists() else ""):
            assert time.monotonic() < deadline and first.poll() is None, "first job never ran"
            time.sleep(0.05)
        job_id = log.read_text().split()[3]
        second = run_dsrun(*ONE, "--log_dir", str(logs), str(script))
        assert second.returncode != 0, second.stderr
        assert f"{log} is being written by another running dsrun job, job id {job_id[:12]}" \
            in second.stderr, second.stderr
        assert "first job up" not in second.stdout  # nothing of it started
    finally:
        go.touch()
        out, err = first.communicate(timeout=30)
    assert first.returncode == 0, err
    lines = log.read_text().splitlines()
    assert [line.split()[3] for line in lines if line.startswith("# dsrun job ")] == [job_id]
    assert lines[1:] == ["first job up", "first job done"]
