"""Real processes: a rank that fails of its own while a preemption signal
stops the job (SIGTERM to every process of the job) is named as failed; the
job still ends as stopped by SIGTERM (143) without a --max_restarts restart.

The ranks run tests/proc/workers/stop_crash.py (no torch): on SIGTERM rank 1
raises, dies of SIGSEGV or calls os._exit(3); rank 0 exits 0. The old
report named only the first (and no crash at all): "stopped by SIGTERM;
every rank was stopped" was all a SIGSEGV left.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from tests.conftest import WORKERS, descendants, start_dsrun, wait_for_pids, wait_gone

pytestmark = pytest.mark.proc


@pytest.mark.parametrize("how,said", [
    ("raise", "(exit code 1): RuntimeError: rank 1: the save on SIGTERM broke"),
    ("segv", "(killed by signal SIGSEGV): a crash of its own, not SIGTERM's doing"),
    ("exit3", "(exit code 3): an exit of its own, not SIGTERM's doing")])
def test_a_rank_that_fails_of_its_own_during_a_preemption_is_named(pid_dir, how, said):
    proc = start_dsrun("--cpu", "--num_gpus", "2", "--dist_backend", "none",
                       "--max_restarts", "1", str(WORKERS / "stop_crash.py"),
                       "--pid_dir", str(pid_dir), "--how", how)
    try:
        wait_for_pids(pid_dir, 2)
        time.sleep(0.3)  # the ranks' handlers are in place
        job = [proc.pid, *descendants(proc.pid)]
        for pid in job:  # the scheduler signals every process of the job
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert "rank 1 on host " in err and f" failed during the stop {said}" in err, err
    assert "1 rank(s) failed of their own while SIGTERM stopped the job" in err, err
    assert "rank 0 on host" not in err, err  # its clean exit is the stop's
    assert "restarting" not in err and "job failed" not in err, err
    assert err.rstrip().endswith("stopped by SIGTERM; every rank ended (1 of them failed "
                                 "of its own during the stop: above)"), err
    assert wait_gone(job, 5) == []
