"""SIGUSR1 that Slurm delivers to a ``--launcher slurm`` job's steps under
``ProctrackType=proctrack/pgid`` reaches each rank once (agent_forward.py).

proctrack/pgid signals each task's process group only - the agent's; every
rank leads a group of its own - so the agent must forward its own copy.
Since agents of a step never forwarded theirs, no rank got any. This module
runs a Slurm of its own with that setting (the session's uses linuxproc).
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import CLEAN_TIMEOUT_S, SLURM_JOB_END_TIMEOUT_S
from simhosts import SimCluster, preflight
from slurmhosts import SlurmCluster, slurm_preflight
from sshjobs import ROOT, WORKERS, wait_files

pytestmark = pytest.mark.cluster
SAVER = str(WORKERS / "signal_saver.py")


@pytest.fixture(scope="module")
def pgid_slurm() -> Iterator[SlurmCluster]:
    reason = preflight() or slurm_preflight()
    if reason is not None:
        pytest.skip(reason)
    sim = SimCluster(2).start()
    try:
        try:
            slurm = SlurmCluster(sim, "proctrack/pgid").start(timeout=60.0)
        except RuntimeError as exc:
            pytest.skip(f"a test Slurm could not be started here: {exc}")
        try:
            yield slurm
            left = slurm.wait_no_jobs(SLURM_JOB_END_TIMEOUT_S)
            sim.wait_clean(CLEAN_TIMEOUT_S)
            assert left == [], f"Slurm jobs left: {left}"
        finally:
            slurm.teardown()
    finally:
        sim.teardown()


def _job_id(slurm: SlurmCluster) -> str:
    end = time.monotonic() + 30
    while time.monotonic() < end:
        out = subprocess.run(["squeue", "-h", "-o", "%i"], env=slurm.env(), text=True,
                             capture_output=True).stdout.split()
        if out:
            return out[0]
        time.sleep(0.1)
    raise AssertionError("no Slurm job")


def test_under_proctrack_pgid_sigusr1_to_the_steps_reaches_each_rank_once(
        pgid_slurm: SlurmCluster, tmp_path: Path) -> None:
    pid_dir, out = tmp_path / "pids", tmp_path / "out"
    pid_dir.mkdir()
    out.mkdir()
    proc = subprocess.Popen([sys.executable, "-m", "dsrun.launcher.cli", "--launcher", "slurm",
                             "--cpu", "--slurm_args", "--time=5", "--num_nodes", "2",
                             "--num_gpus", "1", "--dist_backend", "none", SAVER,
                             "--pid_dir", str(pid_dir), "--out", str(out), "--usr",
                             "--until_usr", "--settle", "2.5"],
                            env=pgid_slurm.env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=str(ROOT))
    try:
        wait_files(pid_dir, 2, 60)
        time.sleep(0.3)  # the ranks' handlers are in place
        job = _job_id(pgid_slurm)
        subprocess.run(["scancel", "--signal=USR1", job], env=pgid_slurm.env(), check=True)
        try:
            _, err = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:  # no rank got it: they wait on
            proc.terminate()
            _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    copies = {p.name: p.read_text().split() for p in out.iterdir()}
    assert copies == {"usr_0": ["SIGUSR1"], "usr_1": ["SIGUSR1"]}, err
    assert proc.returncode == 0, err
