"""Slurm's own SIGTERM to a ``--launcher slurm`` job, on a real Slurm.

At a time limit, a preemption or ``scancel``, Slurm signals every process
of the job's steps (the node agents, their guards, the ranks); when dsrun
runs in a batch script, it gets the signal as well. The ranks' save on
SIGTERM (tests/proc/workers/signal_saver.py: one second) must complete
within --kill_grace, and the job is reported as stopped by SIGTERM, never
as failed. The autouse fixtures check that nothing is left.

Not covered: srun itself getting SIGTERM (it is in the batch step too). srun
answers SIGTERM with "forcing job termination", SIGKILL to every task of
its step at once, and the ranks get no grace at all (the backend's matter).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from slurmhosts import SlurmCluster
from sshjobs import ROOT, WORKERS, wait_files

from tests.conftest import wait_gone

pytestmark = pytest.mark.cluster
SAVER = str(WORKERS / "signal_saver.py")


def _job_id(slurm: SlurmCluster) -> str:
    end = time.monotonic() + 30
    while time.monotonic() < end:
        out = subprocess.run(["squeue", "-h", "-o", "%i"], env=slurm.env(), text=True,
                             capture_output=True).stdout.split()
        if out:
            return out[0]
        time.sleep(0.1)
    raise AssertionError("no Slurm job")


@pytest.mark.parametrize("launcher_too", [False, True], ids=["steps", "dsrun_too"])
def test_slurm_s_sigterm_to_the_whole_job_lets_the_ranks_save(slurm_cluster: SlurmCluster,
                                                              tmp_path: Path,
                                                              launcher_too: bool) -> None:
    pid_dir, out = tmp_path / "pids", tmp_path / "out"
    pid_dir.mkdir()
    out.mkdir()
    proc = subprocess.Popen([sys.executable, "-m", "dsrun.launcher.cli", "--launcher", "slurm",
                             "--cpu", "--slurm_args", "--time=5", "--num_nodes", "2",
                             "--num_gpus", "1", "--dist_backend", "none", "--kill_grace", "10",
                             SAVER, "--pid_dir", str(pid_dir), "--out", str(out), "--stop",
                             "SIGTERM"], env=slurm_cluster.env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=str(ROOT))
    try:
        pids = wait_files(pid_dir, 2, 60)
        time.sleep(0.3)  # the ranks' handlers are in place
        job = _job_id(slurm_cluster)
        subprocess.run(["scancel", "--signal=TERM", job], env=slurm_cluster.env(), check=True)
        if launcher_too:  # dsrun in the batch step (not its srun: see the module docstring)
            os.kill(proc.pid, signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
        assert wait_gone(list(pids.values()), 15) == []
    finally:
        proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert "stopped by SIGTERM; every rank was stopped" in err, err
    assert "job failed" not in err and "SIGKILL" not in err, err
    assert sorted(p.name for p in out.iterdir()) == ["saved_0", "saved_1"], err
