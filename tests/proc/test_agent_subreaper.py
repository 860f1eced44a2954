"""Processes a rank leaves behind after dropping its group, session and
environment (so the job marker too) are still stopped with the job: the
node agent is their child subreaper (Linux). And a node agent whose guard
is killed mid-job fails the host instead of running on unprotected."""

from __future__ import annotations

import os
import signal
import sys
import time

import psutil
import pytest

from tests.conftest import WORKERS, alive, run_dsrun, start_dsrun, wait_for_pids, wait_gone

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="PR_SET_CHILD_SUBREAPER is Linux's")


def test_descendants_without_group_session_or_environment_end_with_the_job(tmp_path):
    res = run_dsrun("--cpu", "--num_gpus", "2", "--dist_backend", "none",
                    str(WORKERS / "escape_env.py"), "--pid_dir", str(tmp_path), timeout=60)
    pids = {f.name: int(f.read_text()) for f in tmp_path.glob("*.pid")}
    try:
        assert res.returncode == 0, res.stderr
        assert len(pids) == 4, pids
        assert wait_gone(list(pids.values()), 5) == [], \
            f"left behind: {[n for n, p in pids.items() if alive(p)]}"
    finally:
        for pid in pids.values():
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


def _guard_of(agent: psutil.Process) -> psutil.Process:
    end = time.monotonic() + 10
    while time.monotonic() < end:
        for child in agent.children():
            if child.name() == "dsrun-guard":
                return child
        time.sleep(0.05)
    raise AssertionError("no dsrun-guard below the agent")


def test_a_killed_guard_fails_the_host(tmp_path):
    proc = start_dsrun("--cpu", "--num_gpus", "1", "--dist_backend", "none",
                       str(WORKERS / "hang.py"), "--pid_dir", str(tmp_path), "--finish", "none")
    try:
        pids = wait_for_pids(tmp_path, 1)
        rank = psutil.Process(next(iter(pids.values())))
        agent = rank.parent()
        assert agent is not None and "dsrun.launcher.agent" in " ".join(agent.cmdline())
        _guard_of(agent).kill()
        out, err = proc.communicate(timeout=20)
    finally:
        proc.kill()
    assert proc.returncode == 1, err
    assert "guard process (pid " in err and "killed by SIGKILL" in err, err
    assert not alive(rank.pid)
