"""Real mpirun: one silent node agent under --heartbeat_timeout (SIGSTOP)
where every rank has an agent of its own. It is that agent, named by its
rank, not "host vm lost" with every rank of the host (explore22-mpisig
finding 5). Skipped without mpirun."""

from __future__ import annotations

import os
import shutil
import signal

import psutil
import pytest

from tests.conftest import WORKERS, start_dsrun, wait_for_pids, wait_gone

pytestmark = [pytest.mark.proc,
              pytest.mark.skipif(shutil.which("mpirun") is None, reason="mpirun not installed")]
MPIRUN_ROOT = ["--allow-run-as-root"] if os.geteuid() == 0 else []


def test_a_silent_agent_of_one_rank_is_named_by_its_rank(pid_dir):
    proc = start_dsrun("--launcher", "openmpi", "--launcher_args", " ".join(MPIRUN_ROOT),
                       "--cpu", "--num_gpus", "2", "--dist_backend", "none",
                       "--heartbeat_timeout", "3", "--kill_grace", "2",
                       str(WORKERS / "hang.py"), "--pid_dir", str(pid_dir), "--finish", "none")
    agent = None
    try:
        pids = wait_for_pids(pid_dir, 2, timeout=60)
        job = [proc.pid, *(p.pid for p in psutil.Process(proc.pid).children(recursive=True))]
        agent = psutil.Process(pids["rank_1.pid"]).parent()
        assert agent is not None
        agent.send_signal(signal.SIGSTOP)
        _, err = proc.communicate(timeout=90)
    finally:
        if agent is not None:
            try:
                agent.send_signal(signal.SIGCONT)
            except psutil.Error:
                pass
        proc.kill()
    assert proc.returncode == 1, err
    assert "dsrun: the agent of rank 1 on host " in err and " lost: nothing heard from it " \
        "for " in err, err
    first = next(ln for ln in err.splitlines() if "job failed:" in ln)
    assert "job failed: the agent of rank 1 on host " in first, err
    assert "rank(s) 1 ran there" in first and "0,1" not in first, err
    assert "rank 1 on host " in err and " could not be confirmed stopped" in err, err
    assert "rank 0, 1 on host" not in err, err
    assert wait_gone(job, 10) == []
