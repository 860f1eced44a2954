"""ConnectedHandle.close: how long the launch tool gets once the agents'
links have ended (connect.py), with socketpair agents and a shell standing
in for mpirun/srun."""

from __future__ import annotations

import socket
import subprocess
import sys
import time

from dsrun.launcher import protocol
from dsrun.launcher.backends import slurm
from dsrun.launcher.backends.connect import ConnectedHandle, LaunchTool, SocketChannel
from dsrun.launcher.spec import HostsSpec

# exits 0 on SIGTERM (srun ending its step), never by itself
TOOL = ["sh", "-c", "trap 'exit 0' TERM; while :; do sleep 0.05; done"]


def _handle(tool: LaunchTool, said_done: list[bool], grace: float,
            ended_wait: tuple[float, float] | None) -> ConnectedHandle:
    channels = []
    for rank, done in enumerate(said_done):
        ours, theirs = socket.socketpair()
        channels.append(SocketChannel(ours, {"rank": rank, "host": "h"}, tool))
        with theirs.makefile("wb") as out:
            if done:
                protocol.write(out, {"ev": "done"})
        theirs.close()  # the agent's link ends (done, or lost)
    handle = ConnectedHandle(channels, [0], tool, grace, ended_wait)
    for c in channels:
        assert c.wait(5) == 0
    return handle


def _closed_in(handle: ConnectedHandle) -> float:
    began = time.monotonic()
    handle.close(timeout=1)
    return time.monotonic() - began


def test_a_tool_with_the_agents_secret_is_sigkilled_without_a_sigterm():
    """mpirun: once every agent said done, ENDED_WAIT then SIGKILL (a
    SIGTERM only starts its kill sequence's sleep)."""
    tool = LaunchTool("mpirun", TOOL, {"PATH": "/usr/bin:/bin"}, "/", lambda *a: None,
                      secret="s3cret")
    took = _closed_in(_handle(tool, [True, True], 30, (0.3, 0.0)))
    assert tool.proc.returncode == -9
    assert took < 2, took


def test_a_lost_agent_with_none_left_on_this_host_costs_no_grace():
    """An agent that never said done: mpirun may sleep out --kill_grace + 10 s,
    but with no agent of the job left here dsrun SIGKILLs it at once."""
    tool = LaunchTool("mpirun", TOOL, {"PATH": "/usr/bin:/bin"}, "/", lambda *a: None,
                      secret="s3cret")
    took = _closed_in(_handle(tool, [True, False], 30, (0.3, 0.0)))
    assert tool.proc.returncode == -9
    assert took < 3, took


def test_a_lost_agent_still_here_is_waited_for_then_sigkilled():
    """The lost agent (a process with the job's secret) still runs: mpirun
    gets --kill_grace + 10 s, then both are SIGKILLed."""
    agent = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                             env={protocol.SECRET_VAR: "s3cret2"})
    try:
        tool = LaunchTool("mpirun", TOOL, {"PATH": "/usr/bin:/bin"}, "/", lambda *a: None,
                          secret="s3cret2")
        handle = _handle(tool, [True, False], 0, (0.3, 0.0))
        took = _closed_in(handle)
        assert agent.wait(5) == -9
        assert 9 < took < 14, took  # grace 0 + TOOL_EXIT_GRACE
    finally:
        agent.kill()


def test_srun_gets_a_short_wait_when_its_agents_links_ended(monkeypatch):
    """A lost agent under slurm: srun cannot exit while it hangs, and it was
    given --kill_grace + 10 s (40 s by default) before its SIGTERM, which
    makes it end its step's tasks."""
    from tests.unit.test_mpi_slurm_argv import _plan

    seen: dict = {}
    monkeypatch.setattr(slurm, "open_connected", lambda *a, **kw: seen.update(kw))
    backend = slurm.SlurmBackend(HostsSpec(launcher="slurm"), environ={"SLURM_JOB_ID": "1"})
    backend.open(_plan(num_gpus=1), lambda *a: None)
    assert seen["ended_wait"] == slurm.ENDED_WAIT
    assert sum(slurm.ENDED_WAIT) <= 15
    assert not seen.get("kill_agents")  # srun's SIGTERM ends the step's tasks itself
