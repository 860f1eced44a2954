"""A SIGTERM that reaches mpirun itself under ``--launcher openmpi``: the
ranks still get --kill_grace, and a save on SIGTERM completes.

mpirun stops its processes (the agents) with SIGCONT, then SIGTERM and
SIGKILL ``odls_base_sigkill_timeout`` seconds apart; Open MPI's default of
1 s cut a 1.5 s save off. dsrun sets the timeout from --kill_grace
(openmpi.py).
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import sys
import time
import uuid

import psutil
import pytest

from dsrun.launcher.backends.connect import LaunchTool
from dsrun.launcher.backends.openmpi import SIGKILL_TIMEOUT, remove_session_dir, session_dirs
from tests.conftest import WORKERS, start_dsrun, wait_for_pids, wait_gone

pytestmark = [pytest.mark.proc,
              pytest.mark.skipif(shutil.which("mpirun") is None, reason="mpirun not installed")]
SAVER = str(WORKERS / "signal_saver.py")


def _mpirun_of(dsrun_pid: int, timeout: float = 10) -> psutil.Process:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        for child in psutil.Process(dsrun_pid).children():
            if child.name() == "mpirun":
                return child
        time.sleep(0.1)
    raise AssertionError("no mpirun below dsrun")


def test_sigterm_to_mpirun_alone_leaves_the_ranks_their_kill_grace(tmp_path, pid_dir):
    out = tmp_path / "out"
    out.mkdir()
    proc = start_dsrun("--launcher", "openmpi", "--cpu", "--num_gpus", "2",
                       "--dist_backend", "none", "--kill_grace", "4", SAVER,
                       "--pid_dir", str(pid_dir), "--out", str(out), "--stop", "SIGTERM",
                       "--save", "1.5")
    try:
        pids = wait_for_pids(pid_dir, 2, 30)
        time.sleep(0.3)  # the ranks' handlers are in place
        _mpirun_of(proc.pid).send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
        assert wait_gone(list(pids.values()), 10) == []
    finally:
        proc.kill()
    # Open MPI's 1 s default SIGKILLed the agents (and so the ranks) mid-save.
    assert sorted(p.name for p in out.iterdir()) == ["saved_0", "saved_1"], err
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert "got SIGTERM" in err, err


def _tagged(tag: str) -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter():
        try:
            if proc.environ().get("DSRUN_TEST_TAG") == tag:
                found.append(proc)
        except (psutil.Error, OSError):
            continue
    return found


@pytest.mark.parametrize("grace", ["4", "20"])
def test_sigterm_to_every_process_under_openmpi_lets_the_ranks_save(tmp_path, pid_dir, grace):
    """As Slurm's proctrack/cgroup signals a batch step running dsrun: dsrun,
    mpirun, the agents, their guards and the ranks, in any order. mpirun's
    own SIGTERM to the agents (1 s later by Open MPI's default) was taken for
    a second signal and SIGKILLed the ranks mid-save. mpirun then sleeps out
    its kill sequence (2 x 21 s for --kill_grace 20): dsrun, whose agents
    have all said done, waits for it only openmpi.ENDED_WAIT, not the grace too."""
    out, tag = tmp_path / "out", uuid.uuid4().hex
    out.mkdir()
    proc = start_dsrun("--launcher", "openmpi", "--cpu", "--num_gpus", "2",
                       "--dist_backend", "none", "--kill_grace", grace, SAVER,
                       "--pid_dir", str(pid_dir), "--out", str(out), "--stop", "SIGTERM",
                       "--save", "2", env={"DSRUN_TEST_TAG": tag})
    try:
        pids = wait_for_pids(pid_dir, 2, 30)
        time.sleep(0.3)  # the ranks' handlers are in place
        job = _tagged(tag)
        assert {p.pid for p in job} >= {proc.pid, *pids.values()}
        random.shuffle(job)
        sent = time.monotonic()
        for p in job:
            try:
                os.kill(p.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        _, err = proc.communicate(timeout=60)
        took = time.monotonic() - sent
        assert wait_gone(list(pids.values()), 10) == []
    finally:
        proc.kill()
    assert sorted(p.name for p in out.iterdir()) == ["saved_0", "saved_1"], err
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert "SIGKILL" not in err, err
    assert took < 8, f"{took:.1f}s: {err}"  # save 2 s, then ENDED_WAIT 0.75 s


@pytest.mark.parametrize("how", ["stop", "kill"])
def test_a_mpirun_sigkilled_in_its_kill_sequence_leaves_no_session_dir(tmp_path, how):
    """With the long kill sequence mpirun may outlast dsrun's wait for it (a
    Ctrl-C while the agents start): SIGKILLed, it cannot remove its session
    directory, so dsrun does (openmpi.remove_session_dir); also after the
    SIGKILL of a stop dsrun gave up on (ConnectedHandle.kill, then close)."""
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    root = ["--allow-run-as-root"] if os.geteuid() == 0 else []
    tool = LaunchTool("mpirun", ["mpirun", *root, "-np", "1", "--mca", SIGKILL_TIMEOUT, "30",
                                 sys.executable, "-c", "import time; time.sleep(60)"],
                      env, str(tmp_path), lambda *a: None,
                      after_kill=lambda pid: remove_session_dir(pid, env))
    pid = tool.proc.pid
    end = time.monotonic() + 20
    while not session_dirs(pid, env) and time.monotonic() < end:
        time.sleep(0.1)
    assert session_dirs(pid, env), sorted(p.name for p in tmp_path.rglob("*"))
    time.sleep(1)  # its process has started
    child = psutil.Process(pid).children()
    try:
        if how == "kill":
            tool.kill()
        tool.stop(0)  # SIGTERM: mpirun sleeps out its 30 s sequence, so SIGKILL 5 s later
        assert tool.proc.returncode == -signal.SIGKILL
        assert session_dirs(pid, env) == []
        # nor the ompi.<host>.<uid> directory above it, empty now
        assert not [p.name for p in tmp_path.iterdir() if p.name.startswith("ompi.")]
    finally:  # mpirun's process outlives it (a dsrun agent would see its link close)
        for proc in child:
            proc.kill()
