"""An agent's connection dropped because srun, signalled itself, killed its
whole step (connect.py): the message says so, though srun has not exited
yet (it waits for the step's end, up to Slurm's KillWait). A stand-in
shell prints srun's line; no Slurm is needed."""

from __future__ import annotations

import socket
import time

import pytest

from dsrun.launcher.backends.connect import LaunchTool, SocketChannel

pytestmark = pytest.mark.proc


def _channel(script: str) -> tuple[SocketChannel, LaunchTool]:
    tool = LaunchTool("srun", ["sh", "-c", script], {"PATH": "/usr/bin:/bin"}, "/",
                      lambda *a: None)
    a, b = socket.socketpair()
    b.close()
    return SocketChannel(a, {"host": "node1", "rank": 1}, tool), tool


def _wait_line(tool: LaunchTool, text: str) -> None:
    end = time.monotonic() + 10
    while time.monotonic() < end and not any(text in ln for ln in tool.output.tail):
        time.sleep(0.02)


def test_a_step_srun_killed_is_named_while_srun_still_runs():
    channel, tool = _channel("echo 'srun: forcing job termination' >&2; exec sleep 30")
    try:
        _wait_line(tool, "forcing job termination")
        assert tool.alive()
        assert channel.exit_message(None, []) == (
            "lost the connection to the agent of rank 1 on node1 (srun got a signal of its "
            "own and killed every task of its step: srun: forcing job termination)")
    finally:
        tool.stop(0)
        channel.close()


def test_without_that_line_the_connection_is_only_lost():
    channel, tool = _channel("echo 'srun: job 7 queued' >&2; exec sleep 30")
    try:
        _wait_line(tool, "queued")
        assert channel.exit_message(None, []) == \
            "lost the connection to the agent of rank 1 on node1"
    finally:
        tool.stop(0)
        channel.close()
