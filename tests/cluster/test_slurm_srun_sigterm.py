"""SIGTERM to the srun of a ``--launcher slurm`` job: srun kills every task
of its step at once ("forcing job termination"), the agents' connections
drop while srun still waits for the step's end, and dsrun's report says
that srun did it (the line connect.ToolOutput.forced keeps), not only that a
connection was lost. Whether that is an interruption (exit 143, no restart)
is the supervisor's to decide (explore22 finding 3): not asserted here.
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


def test_sigterm_to_srun_is_named_as_srun_killing_its_step(slurm_cluster: SlurmCluster,
                                                           tmp_path: Path) -> None:
    pid_dir, out = tmp_path / "pids", tmp_path / "out"
    pid_dir.mkdir()
    out.mkdir()
    proc = subprocess.Popen([sys.executable, "-m", "dsrun.launcher.cli", "--launcher", "slurm",
                             "--cpu", "--slurm_args", "--time=5", "--num_nodes", "2",
                             "--num_gpus", "1", "--dist_backend", "none", SAVER,
                             "--pid_dir", str(pid_dir), "--out", str(out)],
                            env=slurm_cluster.env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=str(ROOT))
    try:
        wait_files(pid_dir, 2, 60)
        _srun_of(proc.pid).send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode != 0, err
    said = [ln for ln in err.splitlines() if ln.startswith("dsrun:")
            and "srun got a signal" in ln and "srun: forcing job termination" in ln]
    assert said, err
