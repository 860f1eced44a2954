"""Hung ranks made visible: straggler lines, --timeout, and ``dsrun stack``.

Ranks run tests/proc/workers/hang.py without torch. Each job gets its own
control-socket directory (XDG_RUNTIME_DIR) so that other dsrun jobs on the
machine never answer these tests' ``dsrun stack``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.conftest import WORKERS, run_dsrun, start_dsrun, wait_for_pids, wait_gone

HANG = str(WORKERS / "hang.py")


@pytest.fixture
def runtime_dir(tmp_path: Path) -> dict[str, str]:
    d = tmp_path / "run"
    d.mkdir(mode=0o700)
    return {"XDG_RUNTIME_DIR": str(d)}


def _job(*extra: str, n: int = 2) -> list[str]:
    return ["--cpu", "--num_gpus", str(n), "--dist_backend", "none", "--kill_grace", "1",
            *extra]


def test_ranks_still_running_are_named_at_growing_intervals(pid_dir, runtime_dir):
    res = run_dsrun(*_job(HANG, "--pid_dir", str(pid_dir), "--finish", "0", "--sleep", "3.5"),
                    env={**runtime_dir, "DSRUN_STRAGGLER_INTERVAL": "0.5"}, timeout=60)
    assert res.returncode == 0, res.stderr
    lines = [ln for ln in res.stderr.splitlines() if "rank(s) finished" in ln]
    # first after 0.5 s, then after 1 s and 2 s more: the intervals double
    assert 2 <= len(lines) <= 4, res.stderr
    assert "1 of 2 rank(s) finished" in lines[0]
    assert "still running: rank 1 on " in lines[0] and "(running " in lines[0]
    assert "dsrun stack " in lines[0]


def test_timeout_ends_the_job_with_124_and_names_the_hung_ranks_with_stacks(pid_dir,
                                                                           runtime_dir):
    start = time.monotonic()
    res = run_dsrun(*_job("--timeout", "4", HANG, "--pid_dir", str(pid_dir), "--finish", "0",
                          n=3), env=runtime_dir, timeout=60)
    took = time.monotonic() - start
    assert res.returncode == 124, res.stderr
    assert took < 4 + 20, took
    err = res.stderr
    assert "job timed out after 4s (--timeout): 2 rank(s) still running" in err
    for rank in (1, 2):
        assert f"rank {rank} on host " in err
        assert f":{rank}]   File \"{HANG}\", line" in err and "in wait_forever" in err
    assert ":0]   File" not in err  # rank 0 had finished: no stack
    pids = [int(p.read_text()) for p in pid_dir.iterdir()]
    assert wait_gone(pids, 5) == []


def _stack(env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    return run_dsrun("stack", *args, env=env, timeout=60)


def test_dsrun_stack_prints_every_running_rank(pid_dir, runtime_dir):
    proc = start_dsrun(*_job(HANG, "--pid_dir", str(pid_dir), "--finish", "none"),
                       env=runtime_dir)
    try:
        pids = wait_for_pids(pid_dir, 2)
        time.sleep(0.5)  # let the ranks reach wait_forever
        res = _stack(runtime_dir)
        assert res.returncode == 0, res.stderr
        for rank in (0, 1):
            frames = [ln for ln in res.stdout.splitlines() if ln.split("]")[0].endswith(
                f":{rank}")]
            assert any("in wait_forever" in ln for ln in frames), res.stdout
            assert any(f'File "{HANG}"' in ln for ln in frames)
        assert "bootstrap.py" not in res.stdout and "<frozen runpy>" not in res.stdout
        assert proc.poll() is None  # asking for stacks does not disturb the ranks
        proc.send_signal(signal.SIGINT)
        proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert wait_gone(list(pids.values()), 5) == []


def test_dsrun_stack_with_no_job_or_several_jobs(pid_dir, runtime_dir, tmp_path):
    res = _stack(runtime_dir)
    assert res.returncode == 2 and "no running dsrun job" in res.stderr
    other = tmp_path / "pids2"
    other.mkdir()
    jobs = [start_dsrun(*_job(HANG, "--pid_dir", str(d), "--finish", "none"), env=runtime_dir)
            for d in (pid_dir, other)]
    try:
        wait_for_pids(pid_dir, 2)
        wait_for_pids(other, 2)
        res = _stack(runtime_dir)
        assert res.returncode == 2 and "2 dsrun jobs are running: name one" in res.stderr
        ids = [ln.split()[0] for ln in res.stderr.splitlines()[1:]]
        assert len(ids) == 2
        one = _stack(runtime_dir, ids[0][:6])
        assert one.returncode == 0 and "in wait_forever" in one.stdout, one.stderr
        assert _stack(runtime_dir, "ffffffffffff").returncode == 2
    finally:
        for job in jobs:
            job.send_signal(signal.SIGINT)
        for job in jobs:
            job.communicate(timeout=30)


def test_stack_of_a_rank_without_the_runtime_is_explained_not_fatal(tmp_path, runtime_dir):
    script = tmp_path / "sleeper.sh"
    script.write_text("#!/bin/sh\necho up\nexec sleep 30\n")
    script.chmod(0o755)
    proc = start_dsrun("--cpu", "--num_gpus", "1", "--no_python", "--kill_grace", "1",
                       str(script), env=runtime_dir)
    try:
        assert proc.stdout is not None
        assert "up" in proc.stdout.readline()
        res = _stack(runtime_dir)
        assert "(no Python stack: the rank runs without dsrun's runtime" in res.stdout, res
        time.sleep(0.3)
        assert proc.poll() is None  # the signal was never sent to it
        proc.send_signal(signal.SIGINT)
        proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert os.listdir(runtime_dir["XDG_RUNTIME_DIR"] + "/dsrun") == []  # socket removed
