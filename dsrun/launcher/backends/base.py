"""What every backend shares: the request objects and the job handle.

A backend's ``prepare(plan)`` is pure and returns a printable Request (one
AgentRequest per node: how the agent is started and the payload it gets on
stdin). ``launch(request)`` starts the agents and returns a JobHandle whose
event queue carries ``(node_index, message)`` pairs from every agent.
"""

from __future__ import annotations

import queue
import threading
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import IO, Any

from dsrun.launcher import protocol
from dsrun.launcher.plan import LaunchPlan, NodePlan, format_command, rank_env

AGENT_MODULE = "dsrun.launcher.agent"


@dataclass(frozen=True)
class AgentRequest:
    host: str
    argv: tuple[str, ...]
    payload: dict[str, Any]


@dataclass(frozen=True)
class Request:
    backend: str
    plan: LaunchPlan
    agents: tuple[AgentRequest, ...]

    def describe(self) -> list[str]:
        """Dry-run text: agent commands and each rank's command and environment."""
        lines = []
        for agent in self.agents:
            lines.append(f"node {agent.host}: agent {format_command(agent.argv)}")
            for rank in agent.payload["ranks"]:
                lines.append(f"  rank {rank['rank']} (local {rank['local_rank']}): "
                             f"{format_command(rank['argv'])}")
                shown = {**agent.payload.get("host_env", {}), **rank["env"]}
                for key in sorted(shown):
                    lines.append(f"    {key}={shown[key]}")
                for key in sorted(agent.payload.get("env", {})):
                    lines.append(f"    {key}=<forwarded, value not shown>")
                if agent.payload.get("inherit_env", True):
                    lines.append("    (plus the environment dsrun was started with)")
        return lines


def agent_payload(plan: LaunchPlan, node: NodePlan, forwarded: dict[str, str] | None = None,
                  inherit_env: bool = True,
                  host_env: dict[str, str] | None = None) -> dict[str, Any]:
    """The start message for one node's agent (JSON-serialisable)."""
    return {
        "job_id": plan.job_id,
        "restart_count": plan.restart_count,
        "cwd": plan.cwd,
        "kill_grace": plan.kill_grace,
        "log_dir": plan.log_dir,
        "inherit_env": inherit_env,
        "env": dict(forwarded or {}),
        "host_env": dict(host_env or {}),
        "ranks": [
            {"rank": s.rank, "local_rank": s.local_rank, "argv": list(plan.command),
             "env": rank_env(plan, node, s)}
            for s in node.ranks
        ],
    }


class AgentChannel(ABC):
    """One running agent: a byte stream each way plus a hard stop."""

    host: str

    @abstractmethod
    def stdin(self) -> IO[bytes]: ...

    @abstractmethod
    def stdout(self) -> IO[bytes]: ...

    @abstractmethod
    def kill(self) -> None:
        """Tear the agent down without its cooperation."""

    @abstractmethod
    def wait(self, timeout: float | None = None) -> int | None:
        """Exit status of the agent, or None if still running after timeout."""


class JobHandle:
    """The launcher's view of a running job: agents and their events."""

    def __init__(self, channels: list[AgentChannel], payloads: list[dict[str, Any]]) -> None:
        self.channels = channels
        self.events: queue.Queue[tuple[int, dict[str, Any]]] = queue.Queue()
        for index, (channel, payload) in enumerate(zip(channels, payloads)):
            self._send(channel, payload)
            threading.Thread(target=self._pump, args=(index, channel), daemon=True).start()

    def _pump(self, index: int, channel: AgentChannel) -> None:
        stream = channel.stdout()
        for line in iter(stream.readline, b""):
            try:
                msg = protocol.decode(line)
            except ValueError:
                msg = {"ev": "garbage", "line": line.decode("utf-8", "replace").rstrip()}
            self.events.put((index, msg))
        self.events.put((index, {"ev": "eof"}))

    @staticmethod
    def _send(channel: AgentChannel, obj: dict[str, Any]) -> None:
        try:
            protocol.write(channel.stdin(), obj)
        except (BrokenPipeError, OSError, ValueError):
            pass  # the agent is gone; its eof event reports it

    def stop(self) -> None:
        """Ask every agent to stop its ranks (SIGTERM, grace, SIGKILL)."""
        for channel in self.channels:
            self._send(channel, {"cmd": "stop"})

    def kill(self) -> None:
        for channel in self.channels:
            channel.kill()

    def close(self) -> None:
        for channel in self.channels:
            try:
                channel.stdin().close()
            except OSError:
                pass
            channel.wait(timeout=5)


class Backend(ABC):
    name: str

    @abstractmethod
    def prepare(self, plan: LaunchPlan) -> Request: ...

    @abstractmethod
    def launch(self, request: Request) -> JobHandle: ...
