"""Real mpirun: an agent lost (``--heartbeat_timeout``) that stays hung -
SIGSTOPped again whenever mpirun's kill sequence SIGCONTs it - does not
outlive dsrun: mpirun gets --kill_grace + 10 s, then dsrun SIGKILLs it and
the agents it leaves on this host (backends/tool_stop.py). dsrun SIGKILLed
mpirun 2 s after a SIGTERM before, and the hung agent, its rank below it,
stayed. Skipped without mpirun."""

from __future__ import annotations

import os
import shutil
import signal
import threading
import time

import psutil
import pytest

from tests.conftest import WORKERS, start_dsrun, wait_for_pids, wait_gone

pytestmark = [pytest.mark.proc,
              pytest.mark.skipif(shutil.which("mpirun") is None, reason="mpirun not installed")]
MPIRUN_ROOT = ["--allow-run-as-root"] if os.geteuid() == 0 else []


def _keep_stopped(proc: psutil.Process, until: threading.Event) -> None:
    while not until.wait(0.05):
        try:
            proc.send_signal(signal.SIGSTOP)
        except psutil.Error:
            return


def test_a_hung_lost_agent_does_not_outlive_dsrun(pid_dir):
    proc = start_dsrun("--launcher", "openmpi", "--launcher_args", " ".join(MPIRUN_ROOT),
                       "--cpu", "--num_gpus", "2", "--dist_backend", "none",
                       "--heartbeat_timeout", "3", "--kill_grace", "5",
                       str(WORKERS / "hang.py"), "--pid_dir", str(pid_dir), "--finish", "none")
    agent, done = None, threading.Event()
    try:
        pids = wait_for_pids(pid_dir, 2, timeout=60)
        job = [proc.pid, *(p.pid for p in psutil.Process(proc.pid).children(recursive=True))]
        agent = psutil.Process(pids["rank_1.pid"]).parent()
        assert agent is not None
        threading.Thread(target=_keep_stopped, args=(agent, done), daemon=True).start()
        began = time.monotonic()
        _, err = proc.communicate(timeout=90)
        took = time.monotonic() - began
        left = wait_gone(job, 3)
    finally:
        done.set()
        proc.kill()
        if agent is not None:
            try:
                agent.kill()
            except psutil.Error:
                pass
    assert proc.returncode == 1, err
    assert left == [], (left, err)
    assert took < 3 + 5 + 10 + 8, f"{took:.1f}s: {err}"  # heartbeat, grace + 10, the stop
