"""SIGUSR1 that Slurm delivers to a ``--launcher slurm`` job's steps reaches
each rank once (agent_forward.py).

``scancel --signal=USR1`` (what ``#SBATCH --signal=USR1@N`` without ``B:``
sends) signals every process of the step: the ranks get it from Slurm, and
the node agents, tasks of that step, must not pass their own copy on. A
requeue handler (Lightning's, submitit's) would otherwise save and requeue
twice. The autouse fixtures check that nothing is left.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
from slurmhosts import SlurmCluster
from sshjobs import ROOT, WORKERS, wait_files

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


def test_slurm_s_sigusr1_to_the_steps_reaches_each_rank_once(slurm_cluster: SlurmCluster,
                                                             tmp_path: Path) -> None:
    pid_dir, out = tmp_path / "pids", tmp_path / "out"
    pid_dir.mkdir()
    out.mkdir()
    # Each rank exits 2.5 s after its first copy: a second one (the agent's
    # forward came 0.5 s after Slurm's) is counted before that.
    proc = subprocess.Popen([sys.executable, "-m", "dsrun.launcher.cli", "--launcher", "slurm",
                             "--cpu", "--slurm_args", "--time=5", "--num_nodes", "2",
                             "--num_gpus", "1", "--dist_backend", "none", SAVER,
                             "--pid_dir", str(pid_dir), "--out", str(out), "--usr",
                             "--until_usr", "--settle", "2.5"],
                            env=slurm_cluster.env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=str(ROOT))
    try:
        wait_files(pid_dir, 2, 60)
        time.sleep(0.3)  # the ranks' handlers are in place
        job = _job_id(slurm_cluster)
        subprocess.run(["scancel", "--signal=USR1", job], env=slurm_cluster.env(), check=True)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 0, err
    copies = {p.name: p.read_text().split() for p in out.iterdir()}
    assert copies == {"usr_0": ["SIGUSR1"], "usr_1": ["SIGUSR1"]}, err
