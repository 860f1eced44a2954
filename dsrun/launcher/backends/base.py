"""What every backend shares: the request objects and the job handle.

A backend's ``prepare(plan)`` is pure and returns a printable Request (one
AgentRequest per node: how the agent is started and the payload it gets on
stdin). ``launch(request)`` starts the agents and returns a JobHandle whose
event queue carries ``(node_index, message)`` pairs from every agent.

Launching is two steps so that a multi-host job can probe its hosts first
(protocol.py): ``open(hosts, cwd, local)`` starts one agent per host, waiting
for its first line, and returns the JobHandle; ``handle.start(payloads)``
sends the start payloads. ``launch`` is the two in a row.
"""

from __future__ import annotations

import collections
import queue
import threading
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import IO, Any

from dsrun.launcher import protocol
from dsrun.launcher.plan import LaunchPlan, NodePlan, format_command, rank_argv, rank_env

AGENT_MODULE = "dsrun.launcher.agent"
STDERR_TAIL = 20


@dataclass(frozen=True)
class AgentRequest:
    host: str
    argv: tuple[str, ...]
    payload: dict[str, Any]
    # How the agent is reached, for people: "" (a local child process) or
    # e.g. "ssh root@10.0.0.2:22"; remote_command is the line sshd runs.
    transport: str = ""
    remote_command: str | None = None


@dataclass(frozen=True)
class Request:
    backend: str
    plan: LaunchPlan
    agents: tuple[AgentRequest, ...]

    def describe(self) -> list[str]:
        """Dry-run text: agent commands and each rank's command and environment."""
        lines = []
        hidden = self.plan.user_env.describe()
        for agent in self.agents:
            if agent.remote_command is None:
                lines.append(f"node {agent.host}: agent {format_command(agent.argv)}")
                base = "the environment dsrun was started with"
            else:
                lines.append(f"node {agent.host}: {agent.transport}: {agent.remote_command}")
                base = f"the login environment of {agent.host}"
            for rank in agent.payload["ranks"]:
                lines.append(f"  rank {rank['rank']} (local {rank['local_rank']}): "
                             f"{format_command(rank['argv'])}")
                shown = {**agent.payload.get("host_env", {}), **rank["env"]}
                for key in sorted(shown):
                    lines.append(f"    {key}={shown[key]}")
                lines.extend(f"    {line}" for line in hidden)
                if agent.payload.get("path_prepend"):
                    lines.append(f"    PATH=<{':'.join(agent.payload['path_prepend'])} "
                                 f"in front of the host's PATH>")
                if agent.payload.get("inherit_env", True):
                    lines.append(f"    (plus {base})")
        return lines


def agent_payload(plan: LaunchPlan, node: NodePlan, forwarded: dict[str, str] | None = None,
                  inherit_env: bool = True, host_env: dict[str, str] | None = None,
                  path_prepend: Sequence[str] = ()) -> dict[str, Any]:
    """The start message for one node's agent (JSON-serialisable).

    ``env`` (the user's and forwarded variables) overrides the agent's own
    environment; ``host_env`` only fills in what is not set there or in
    ``env``; each rank's ``env`` (dsrun's variables) overrides everything.
    """
    return {
        "job_id": plan.job_id,
        "restart_count": plan.restart_count,
        "cwd": plan.cwd,
        "kill_grace": plan.kill_grace,
        "log_dir": plan.log_dir,
        "inherit_env": inherit_env,
        "env": dict(forwarded or {}),
        "host_env": dict(host_env or {}),
        "path_prepend": list(path_prepend),
        "ranks": [
            {"rank": s.rank, "local_rank": s.local_rank, "argv": rank_argv(plan, s),
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

    def stderr(self) -> IO[bytes] | None:
        """The agent's stderr when the launcher must relay it (None: inherited)."""
        return None

    def exit_message(self, code: int | None, err_tail: Sequence[str]) -> str:
        """Why the agent went away before saying ``done``."""
        return f"node agent exited unexpectedly (status {code})"

    def close(self) -> None:  # noqa: B027 - most channels hold nothing to release
        """Release the transport once the agent is gone (or given up on)."""


class JobHandle:
    """The launcher's view of a running job: agents and their events.

    Besides the agents' own messages, the queue carries ``eof`` when an
    agent's stdout ends and ``agent_err`` for each line an agent writes on a
    relayed stderr (the last lines are kept for error messages).
    """

    def __init__(self, channels: list[AgentChannel],
                 payloads: list[dict[str, Any]] | None = None) -> None:
        self.channels = channels
        self.events: queue.Queue[tuple[int, dict[str, Any]]] = queue.Queue()
        self.err_tails = [collections.deque(maxlen=STDERR_TAIL) for _ in channels]
        self._stderr_pumps: dict[int, threading.Thread] = {}
        for index, channel in enumerate(channels):
            err = channel.stderr()
            if err is not None:
                t = threading.Thread(target=self._pump_err, args=(index, err), daemon=True)
                t.start()
                self._stderr_pumps[index] = t
            threading.Thread(target=self._pump, args=(index, channel), daemon=True).start()
        if payloads is not None:
            self.start(payloads)

    def start(self, payloads: Sequence[dict[str, Any]]) -> None:
        """Send each agent its start payload: from here on ranks run."""
        for channel, payload in zip(self.channels, payloads):
            self._send(channel, payload)

    def send(self, index: int, obj: dict[str, Any]) -> None:
        self._send(self.channels[index], obj)

    def _pump(self, index: int, channel: AgentChannel) -> None:
        stream = channel.stdout()
        try:
            for line in iter(stream.readline, b""):
                try:
                    msg = protocol.decode(line)
                except ValueError:
                    msg = {"ev": "garbage", "line": line.decode("utf-8", "replace").rstrip()}
                self.events.put((index, msg))
        except (OSError, EOFError):
            pass  # transport gone: same as end of output
        err_pump = self._stderr_pumps.get(index)
        if err_pump is not None:  # its last lines explain an exit
            err_pump.join(timeout=0.5)
        self.events.put((index, {"ev": "eof"}))

    def _pump_err(self, index: int, stream: IO[bytes]) -> None:
        try:
            for raw in iter(stream.readline, b""):
                line = raw.decode("utf-8", "replace").rstrip("\n")
                self.err_tails[index].append(line)
                self.events.put((index, {"ev": "agent_err", "line": line}))
        except (OSError, EOFError):
            pass

    def exit_message(self, index: int, code: int | None) -> str:
        return self.channels[index].exit_message(code, tuple(self.err_tails[index]))

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
        """End of stdin for every agent (stop now), then wait for them."""
        for channel in self.channels:
            try:
                channel.stdin().close()
            except (OSError, EOFError):
                pass
        for channel in self.channels:
            channel.wait(timeout=5)
            channel.close()


class Backend(ABC):
    name: str

    @abstractmethod
    def prepare(self, plan: LaunchPlan) -> Request: ...

    @abstractmethod
    def open(self, hosts: Sequence[str], cwd: str, local: Sequence[bool]) -> JobHandle:
        """Start one agent per host, each waiting for its first line."""

    def launch(self, request: Request) -> JobHandle:
        plan = request.plan
        assert plan.final, "launch needs a final plan"
        handle = self.open([a.host for a in request.agents], plan.cwd,
                           [n.local for n in plan.nodes])
        handle.start([a.payload for a in request.agents])
        return handle
