"""Processes that left their rank's group, session and environment (so no
job marker) are killed by the guard when their node agent is SIGKILLed:
the agent, their subreaper, records them with its guard while the job runs,
since once the agent is dead they reparent to init, not to the guard."""

from __future__ import annotations

import os
import signal
import sys
import time

import psutil
import pytest

from tests.conftest import WORKERS, alive, start_dsrun, wait_for_pids, wait_gone

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="PR_SET_CHILD_SUBREAPER is Linux's")

STAY = f"""\
import runpy, sys, time
runpy.run_path({str(WORKERS / "escape_env.py")!r}, run_name="__main__")
time.sleep(60)  # the rank stays: only the agent's death ends the job
"""


def _agent_of(launcher: int) -> psutil.Process:
    end = time.monotonic() + 10
    while time.monotonic() < end:
        for child in psutil.Process(launcher).children():
            if "dsrun.launcher.agent" in " ".join(child.cmdline()):
                return child
        time.sleep(0.05)
    raise AssertionError("no node agent below dsrun")


def _wait_below(agent: psutil.Process, pids: list[int], timeout: float = 10) -> None:
    """Wait until every pid is a descendant of the agent (the rank, or the
    agent as their subreaper): only then can the agent record them."""
    end = time.monotonic() + timeout
    while True:
        below = {c.pid for c in agent.children(recursive=True)}
        if set(pids) <= below:
            return
        if time.monotonic() > end:
            raise AssertionError(f"{sorted(set(pids) - below)} not below the agent "
                                 f"{agent.pid} after {timeout}s")
        time.sleep(0.05)


def test_escaped_processes_die_with_a_sigkilled_agent(tmp_path, pid_dir):
    script = tmp_path / "stay.py"
    script.write_text(STAY)
    proc = start_dsrun("--cpu", "--num_gpus", "1", "--dist_backend", "none", str(script),
                       "--pid_dir", str(pid_dir))
    pids: dict[str, int] = {}
    try:
        pids = wait_for_pids(pid_dir, 2)
        agent = _agent_of(proc.pid)
        _wait_below(agent, list(pids.values()))
        # The agent records them with its guard every 0.5 s; the guard's list
        # cannot be seen from here, so give it six cycles (a starved loop).
        time.sleep(3)
        agent.send_signal(signal.SIGKILL)
        proc.communicate(timeout=30)
        assert wait_gone(list(pids.values()), 10) == [], \
            f"outlived the agent: {[n for n, p in pids.items() if alive(p)]}"
    finally:
        proc.kill()
        for pid in pids.values():
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
