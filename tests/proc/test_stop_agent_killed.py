"""Real processes: SIGTERM to dsrun, then its node agent is SIGKILLed while
the ranks save (what mpirun or srun do when they end a stop). The agent
never confirmed its ranks' stop: dsrun must not say "every rank was
stopped" (explore22-mpisig finding 2: it did, and no save was written).
"""

from __future__ import annotations

import os
import signal
import time

import psutil
import pytest

from tests.conftest import WORKERS, descendants, start_dsrun, wait_for_pids, wait_gone

pytestmark = pytest.mark.proc
SAVER = str(WORKERS / "signal_saver.py")


def test_an_agent_killed_during_a_signals_stop_leaves_its_ranks_unconfirmed(pid_dir,
                                                                           tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    proc = start_dsrun("--cpu", "--num_gpus", "2", "--dist_backend", "none", "--kill_grace",
                       "20", SAVER, "--pid_dir", str(pid_dir), "--out", str(out),
                       "--stop", "SIGTERM", "--save", "5")
    try:
        wait_for_pids(pid_dir, 2)
        time.sleep(0.3)  # the ranks' handlers are in place
        job = [proc.pid, *descendants(proc.pid)]
        agent = next(p for p in job[1:] if psutil.Process(p).ppid() == proc.pid)
        os.kill(proc.pid, signal.SIGTERM)
        time.sleep(1.0)  # the ranks are saving
        os.kill(agent, signal.SIGKILL)
        _, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert list(out.iterdir()) == [], err  # the saves were cut off
    assert "every rank was stopped" not in err, err
    assert "rank 0, 1 on host " in err and " could not be confirmed stopped: the agent ended " \
        "before confirming their stop" in err, err
    last = err.rstrip().splitlines()[-1]
    assert last.startswith("dsrun: stopped by SIGTERM; could not confirm the stop of rank 0, "
                           "1 on host "), err
    assert wait_gone(job, 5) == []
