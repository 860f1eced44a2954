"""Local backend: the node agent as a child process of the launcher."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Sequence
from typing import IO

from dsrun.launcher.backends.base import (
    AGENT_MODULE,
    AgentChannel,
    AgentRequest,
    Backend,
    JobHandle,
    Request,
    agent_payload,
)
from dsrun.launcher.devices import usable_cpus
from dsrun.launcher.plan import LaunchPlan, host_env


class LocalChannel(AgentChannel):
    def __init__(self, host: str, argv: tuple[str, ...], cwd: str) -> None:
        self.host = host
        # Own session: a Ctrl-C at the terminal reaches only the launcher,
        # which then stops the job in order instead of every process at once.
        self.proc = subprocess.Popen(
            list(argv), stdin=subprocess.PIPE, stdout=subprocess.PIPE, cwd=cwd,
            start_new_session=True,
        )

    def stdin(self) -> IO[bytes]:
        assert self.proc.stdin is not None
        return self.proc.stdin

    def stdout(self) -> IO[bytes]:
        assert self.proc.stdout is not None
        return self.proc.stdout

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()

    def wait(self, timeout: float | None = None) -> int | None:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return None


class LocalBackend(Backend):
    name = "local"

    def __init__(self, python: str = sys.executable) -> None:
        self.python = python

    def argv(self) -> tuple[str, ...]:
        return (self.python, "-m", AGENT_MODULE)

    def prepare(self, plan: LaunchPlan) -> Request:
        forwarded = plan.user_env.as_dict()
        agents = tuple(
            AgentRequest(node.host, self.argv(),
                         agent_payload(plan, node, forwarded, host_env={
                             **dict(node.env),
                             **host_env(len(node.ranks), usable_cpus(),
                                        {**os.environ, **forwarded})}))
            for node in plan.nodes
        )
        return Request(self.name, plan, agents)

    def open(self, hosts: Sequence[str], cwd: str, local: Sequence[bool]) -> JobHandle:
        channels: list[AgentChannel] = [LocalChannel(h, self.argv(), cwd) for h in hosts]
        return JobHandle(channels)
