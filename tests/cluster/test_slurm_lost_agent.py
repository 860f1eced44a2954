"""``--launcher slurm`` on a real Slurm: a node agent lost to
``--heartbeat_timeout`` (SIGSTOPped) costs srun a short wait, not
``--kill_grace`` + 10 s (slurm.ENDED_WAIT): srun cannot exit while a task
of its step is stopped, and only its SIGTERM makes it end the step."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from slurmhosts import SlurmCluster
from sshjobs import ROOT, WORKERS, wait_files

pytestmark = pytest.mark.cluster


def test_a_lost_agent_under_slurm_costs_no_grace(slurm_cluster: SlurmCluster,
                                                 tmp_path: Path) -> None:
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()
    proc = subprocess.Popen([sys.executable, "-m", "dsrun.launcher.cli", "--launcher", "slurm",
                             "--cpu", "--slurm_args", "--time=5", "--num_nodes", "2",
                             "--num_gpus", "1", "--dist_backend", "none",
                             "--heartbeat_timeout", "3", "--kill_grace", "20",
                             str(WORKERS / "hang.py"), "--pid_dir", str(pid_dir),
                             "--finish", "none"],
                            env=slurm_cluster.env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=str(ROOT))
    agent = None
    try:
        pids = wait_files(pid_dir, 2, 60)
        agent = psutil.Process(pids["rank_1.pid"]).parent()
        assert agent is not None and "dsrun.launcher.agent" in " ".join(agent.cmdline())
        agent.send_signal(signal.SIGSTOP)
        stopped = time.monotonic()
        _, err = proc.communicate(timeout=90)
        took = time.monotonic() - stopped
    finally:
        proc.kill()
        if agent is not None:
            try:
                agent.send_signal(signal.SIGCONT)
            except psutil.Error:
                pass
    assert proc.returncode == 1, err
    assert " lost: nothing heard from it for " in err, err
    # heartbeat 3 s, rank 0's stop, ENDED_WAIT 3 s, srun's end of its step;
    # --kill_grace 20 + 10 s before srun's SIGTERM made it 35 s
    assert took < 16, f"{took:.1f}s: {err}"
    assert slurm_cluster.wait_no_jobs(30) == []
