"""Local backend: the node agent as a child process of the launcher."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Mapping
from typing import IO, TYPE_CHECKING

from dsrun.errors import DsrunUsageError
from dsrun.launcher.backends.agent_env import local_agent_env
from dsrun.launcher.backends.base import (
    AgentChannel,
    AgentRequest,
    Backend,
    ConnectSink,
    JobHandle,
    OutputSink,
    Request,
    agent_payload,
    ignore_connect,
)
from dsrun.launcher.plan import LaunchPlan, format_command
from dsrun.launcher.spec import HostsSpec

if TYPE_CHECKING:
    from dsrun.launcher.cluster import Cluster

#: Layer 1 of a local agent's ranks (rankenv.py).
LOCAL_BASE = "the environment dsrun was started with"


class LocalChannel(AgentChannel):
    watched = False  # a pipe to a child: it closes when the launcher dies

    def __init__(self, host: str, argv: tuple[str, ...], cwd: str,
                 env: Mapping[str, str] | None = None) -> None:
        self.host = host
        # Own session: a Ctrl-C at the terminal reaches only the launcher,
        # which then stops the job in order instead of every process at once.
        self.proc = subprocess.Popen(
            list(argv), stdin=subprocess.PIPE, stdout=subprocess.PIPE, cwd=cwd,
            start_new_session=True, env=env,
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

    def exit_signal(self) -> int | None:
        code = self.proc.returncode
        return -code if code is not None and code < 0 else None


def local_request(backend: Backend, plan: LaunchPlan, index: int,
                  environ: Mapping[str, str]) -> AgentRequest:
    """The request of node ``index``'s agent as a child of the launcher."""
    node = plan.nodes[index]
    return AgentRequest(node.host, agent_payload(plan, node),
                        f"agent {format_command(backend.agent_argv())}", LOCAL_BASE, environ)


class LocalBackend(Backend):
    name = "local"

    def __init__(self, hosts: HostsSpec | None = None, python: str = sys.executable,
                 environ: Mapping[str, str] | None = None) -> None:
        super().__init__(hosts, python)
        self.environ = dict(os.environ if environ is None else environ)

    def check(self, cluster: Cluster) -> None:
        if not all(cluster.local):
            remote = cluster.hosts[cluster.local.index(False)]
            raise DsrunUsageError(f"--launcher local cannot start ranks on {remote} "
                                  f"(from {cluster.source}), which is not this host; use ssh")

    def prepare(self, plan: LaunchPlan) -> Request:
        agents = tuple(local_request(self, plan, i, self.environ)
                       for i in range(len(plan.nodes)))
        return Request(self.name, plan, agents)

    def open(self, plan: LaunchPlan, sink: OutputSink,
             on_connect: ConnectSink = ignore_connect) -> JobHandle:
        channels: list[AgentChannel] = []
        env = local_agent_env(plan.user_env, os.environ)  # the ranks' PYTHONPATH
        for node in plan.nodes:
            channels.append(LocalChannel(node.host, self.agent_argv(), plan.cwd, env))
            on_connect(node.host)
        return JobHandle(channels)
