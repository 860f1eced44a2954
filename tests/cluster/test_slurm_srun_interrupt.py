"""SIGTERM to the srun of a ``--launcher slurm`` job (srun alone, dsrun got
nothing): srun SIGKILLs every task of its step ("forcing job termination").
That is an interruption, as a SIGTERM to mpirun is under --launcher openmpi:
"stopped by SIGTERM", exit 143, no --max_restarts restart, and the ranks
named as killed by srun, not claimed stopped (explore22-mpisig finding 3:
it was "the node agent ... failed first: lost the connection", exit 1, and
a restart). Skipped where Slurm cannot run (conftest.slurm_cluster).
"""

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
SAVER = str(WORKERS / "signal_saver.py")


def _srun_of(pid: int) -> psutil.Process:
    end = time.monotonic() + 30
    while time.monotonic() < end:
        for child in psutil.Process(pid).children():
            if child.name() == "srun":
                return child
        time.sleep(0.1)
    raise AssertionError("no srun below dsrun")


def test_sigterm_to_srun_alone_is_an_interruption_without_restart(slurm_cluster: SlurmCluster,
                                                                   tmp_path: Path) -> None:
    pid_dir, out = tmp_path / "pids", tmp_path / "out"
    pid_dir.mkdir()
    out.mkdir()
    proc = subprocess.Popen([sys.executable, "-m", "dsrun.launcher.cli", "--launcher", "slurm",
                             "--cpu", "--slurm_args", "--time=5", "--num_nodes", "2",
                             "--num_gpus", "1", "--dist_backend", "none", "--max_restarts", "1",
                             SAVER, "--pid_dir", str(pid_dir), "--out", str(out)],
                            env=slurm_cluster.env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=str(ROOT))
    try:
        wait_files(pid_dir, 2, 60)
        _srun_of(proc.pid).send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=90)
    finally:
        proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert "restarting" not in err and "job failed" not in err, err
    assert "srun got a signal (not from dsrun, which got none) and SIGKILLed every task of " \
           "its step" in err, err
    assert "killed with SIGKILL by srun" in err, err
    last = err.rstrip().splitlines()[-1]
    assert last.startswith("dsrun: stopped by SIGTERM; rank 0 on host "), err
    assert last.endswith(" killed with SIGKILL by srun (see above)"), err
