"""Under ``--launcher openmpi`` dsrun SIGKILLs a mpirun that sleeps out its
kill sequence (no SIGTERM: it only starts that sleep), then the agents it
leaves on this host (backends/tool_stop.py): a Ctrl-C while the agents
start leaves nothing of the job running, and a rank's MPI_Abort is reported
within about a second, not after ``--kill_grace``."""

from __future__ import annotations

import os
import shutil
import signal
import sys
import time
import uuid

import psutil
import pytest

from dsrun.launcher import protocol
from dsrun.launcher.backends.connect import LaunchTool
from dsrun.launcher.backends.openmpi import SIGKILL_TIMEOUT, remove_session_dir, session_dirs
from tests.conftest import start_dsrun

pytestmark = [pytest.mark.proc,
              pytest.mark.skipif(shutil.which("mpirun") is None, reason="mpirun not installed")]


def _tagged(tag: str) -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter():
        try:
            if proc.environ().get("DSRUN_TEST_TAG") == tag:
                found.append(proc)
        except (psutil.Error, OSError):
            continue
    return found


def _agents(tag: str) -> list[psutil.Process]:
    out = []
    for p in _tagged(tag):
        try:
            if "dsrun.launcher.agent" in " ".join(p.cmdline()) and p.status() != "zombie":
                out.append(p)
        except psutil.Error:
            continue
    return out


def test_ctrl_c_while_the_agents_start_leaves_none_of_them_running(tmp_path):
    """mpirun, SIGTERMed, slept out its 31 s sequence and was SIGKILLed 5 s
    later, before it killed its agents; an agent not yet connected kept
    dialling the closed port for 30 s after dsrun had exited."""
    tag = uuid.uuid4().hex
    script = tmp_path / "sleep.py"
    script.write_text("import time\ntime.sleep(60)\n")
    proc = start_dsrun("--launcher", "openmpi", "--cpu", "--num_gpus", "2",
                       "--dist_backend", "none", str(script),
                       env={"DSRUN_TEST_TAG": tag, "TMPDIR": str(tmp_path)})
    try:
        end = time.monotonic() + 30
        while not _agents(tag) and time.monotonic() < end:
            time.sleep(0.02)
        assert _agents(tag), "no agent started"
        sent = time.monotonic()
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
        took = time.monotonic() - sent
        time.sleep(1)
        left = [p for p in _tagged(tag) if p.status() != "zombie"]
    finally:
        proc.kill()
        for p in _tagged(tag):
            p.kill()
    assert left == [], (left, err)
    assert took < 3, f"{took:.1f}s: {err}"
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith("ompi.")], err


def test_a_sigkilled_mpirun_leaves_neither_its_agents_nor_its_session_dirs(tmp_path):
    """LaunchTool with the agents' secret (openmpi): stop SIGKILLs mpirun
    at once, then the process it started here, then its session directory
    and the empty ``ompi.<host>.<uid>`` above it."""
    secret = uuid.uuid4().hex
    env = {**os.environ, "TMPDIR": str(tmp_path), protocol.SECRET_VAR: secret}
    root = ["--allow-run-as-root"] if os.geteuid() == 0 else []
    tool = LaunchTool("mpirun", ["mpirun", *root, "-np", "1", "--mca", SIGKILL_TIMEOUT, "30",
                                 sys.executable, "-c", "import time; time.sleep(60)"],
                      env, str(tmp_path), lambda *a: None,
                      after_kill=lambda pid: remove_session_dir(pid, env), secret=secret)
    pid = tool.proc.pid
    end = time.monotonic() + 20
    while not psutil.Process(pid).children() and time.monotonic() < end:
        time.sleep(0.1)
    time.sleep(1)  # its process has started
    child = psutil.Process(pid).children()
    assert child and session_dirs(pid, env)
    try:
        began = time.monotonic()
        tool.stop(0)
        took = time.monotonic() - began
        assert tool.proc.returncode == -signal.SIGKILL
        gone, alive = psutil.wait_procs(child, timeout=2)
        assert alive == []
        assert [p.name for p in tmp_path.iterdir()] == []
        assert took < 2, took  # a SIGTERM first cost 5 s
    finally:
        for p in child:
            if p.is_running():
                p.kill()


def test_mpi_abort_is_reported_within_a_second_or_two(tmp_path):
    """Every agent said done: mpirun gets openmpi.ENDED_WAIT (0.75 s), then
    SIGKILL; a SIGTERM step and a 3 s wait made it 5.4 s."""
    pytest.importorskip("mpi4py")
    script = tmp_path / "abort.py"
    mark = tmp_path / "aborting"
    script.write_text(
        "import time\nfrom mpi4py import MPI\n"
        "if MPI.COMM_WORLD.Get_rank() == 1:\n"
        f"    open({str(mark)!r}, 'w').close()\n"
        "    MPI.COMM_WORLD.Abort(3)\n"
        "time.sleep(60)\n")
    proc = start_dsrun("--launcher", "openmpi", "--cpu", "--num_gpus", "2",
                       "--dist_backend", "none", str(script),
                       env={"TMPDIR": str(tmp_path)})
    try:
        end = time.monotonic() + 30
        while not mark.exists() and time.monotonic() < end:
            time.sleep(0.05)
        aborted = time.monotonic()
        _, err = proc.communicate(timeout=90)
        took = time.monotonic() - aborted
    finally:
        proc.kill()
    assert proc.returncode == 3, err
    assert took < 3, f"{took:.1f}s: {err}"
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith("ompi.")], err
