"""What a backend is, and what every backend shares.

A backend says how node agents start and what it needs to know about the
hosts; nothing outside it asks what kind of backend it is:

- :attr:`Backend.agent_per_rank`: one agent per host (local, ssh) or one
  per rank (openmpi, slurm: mpirun/srun start every rank's process, and
  that process is the agent that starts the rank);
- :attr:`Backend.login_env`: agents on other hosts start in that host's
  login environment, so the launcher forwards variables (envpolicy) and
  puts its interpreter's directory first on PATH;
- :meth:`Backend.pool_without_hostfile`, :meth:`Backend.local_hosts`,
  :meth:`Backend.check`, :meth:`Backend.connect_address`: the hosts of a
  job and what must hold before anything starts;
- :meth:`Backend.prepare` (pure) turns a plan into a printable
  :class:`Request` - what ``--dry-run`` prints is what starts the job;
- :meth:`Backend.open` starts the agents of a (possibly draft) plan, each
  waiting for its first line, and returns a :class:`JobHandle`; the launch
  probes them, builds the final plan, and ``handle.start(request)`` sends
  each agent its part.

A JobHandle's event queue carries ``(channel_index, message)`` pairs from
every agent; channels are in the order of ``Request.agents``. Each message
is stamped with ``_recv``, the launcher's ``time.monotonic()`` when it was
read (the supervisor orders failures by it), and each channel's last such
time is kept (:attr:`JobHandle.last_seen`: the heartbeat check). The handle
sends heartbeats (protocol.py) to every agent once told the timeout.

What else an agent's stdout carries - a remote login shell's greeting, a
forced command's or ``nologin``'s refusal - is kept, not dropped: each such
line is a ``garbage`` event and joins the channel's last lines
(:attr:`JobHandle.tails`, with its stderr), which the messages about an
agent that exited or never answered quote. Text without a final newline
before the agent's first message (``printf 'Welcome'`` in a ``.bashrc``)
is split off that message (:func:`split_glued`), which is read as usual.
"""

from __future__ import annotations

import collections
import json
import os
import queue
import sys
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import IO, TYPE_CHECKING, Any, ClassVar

from dsrun.launcher import protocol
from dsrun.launcher.hostfile import Hostfile
from dsrun.launcher.netinfo import is_local_host
from dsrun.launcher.plan import LaunchPlan, NodePlan, RankSlot, format_command, rank_argv
from dsrun.launcher.rankenv import RankEnv, rank_env
from dsrun.launcher.rankenv import describe as describe_env
from dsrun.launcher.report import signal_name
from dsrun.launcher.spec import HostsSpec

if TYPE_CHECKING:
    from dsrun.launcher.cluster import Cluster

AGENT_MODULE = "dsrun.launcher.agent"
#: How many of an agent's last non-protocol lines (stdout and stderr) are kept.
STDERR_TAIL = 20

# (host, rank, fd, line) -> None; rank AGENT_LINE: the agent itself, TOOL_LINE:
# the command that starts the agents (then host is its name: mpirun, srun)
OutputSink = Callable[[str, int, int, str], None]
# Called with a host name each time an agent is up (started, or connected back).
ConnectSink = Callable[[str], None]


def ignore_connect(host: str) -> None:
    pass
AGENT_LINE = -1
TOOL_LINE = -2


@dataclass(frozen=True)
class HostPool:
    """The hosts a job may use when there is no hostfile (a backend's answer)."""

    hostfile: Hostfile
    named: bool = True  # the names are known before the agents start
    default_ranks: int | None = None  # ranks per host without --num_gpus (None: all slots)


@dataclass(frozen=True)
class AgentRequest:
    """One agent: where, how it starts (for people) and its start payload."""

    host: str
    payload: dict[str, Any]
    start: str  # e.g. "agent /py -m dsrun.launcher.agent", "ssh root@h:22: cd ...", ...
    base: str  # the environment it starts in (layer 1 of rankenv)
    inherited: Mapping[str, str] | None = None  # that environment, when known here


@dataclass(frozen=True)
class Request:
    backend: str
    plan: LaunchPlan
    agents: tuple[AgentRequest, ...]
    # The one command that starts every agent (mpirun, srun); empty when the
    # backend starts them one by one. ``command_env`` names the variables it
    # passes on, whose values are in its environment, never on its line.
    command: tuple[str, ...] = ()
    command_env: tuple[str, ...] = ()

    @property
    def payloads(self) -> list[dict[str, Any]]:
        return [a.payload for a in self.agents]

    def describe(self) -> list[str]:
        """Dry-run text: how agents start, each rank's command and environment."""
        lines = []
        if self.command:
            lines.append(f"launch: {format_command(self.command)}")
            lines.append(f"  ({', '.join(self.command_env)}: values in {self.command[0]}'s "
                         f"environment, never on its command line)")
        started: set[str] = set()
        for agent in self.agents:
            if agent.host not in started:
                started.add(agent.host)
                lines.append(f"node {agent.host}: {agent.start}")
            for rank in agent.payload["ranks"]:
                lines.append(f"  rank {rank['rank']} (local {rank['local_rank']}): "
                             f"{format_command(rank['argv'])}")
                lines.extend(f"    {ln}" for ln in describe_env(
                    RankEnv.from_json(rank["env"]), self.plan.user_env, agent.base,
                    agent.inherited))
        return lines


def agent_payload(plan: LaunchPlan, node: NodePlan,
                  slots: Sequence[RankSlot] | None = None) -> dict[str, Any]:
    """The start message of an agent running ``slots`` of ``node`` (default:
    all of them), JSON-serialisable. User values appear only here.
    ``env_files`` (only when some env-file value is to be expanded): the
    order and expansion of the env-file variables, for the agent."""
    payload: dict[str, Any] = {
        "job_id": plan.job_id,
        "restart_count": plan.restart_count,
        "cwd": plan.cwd,
        "kill_grace": plan.kill_grace,
        "log_dir": plan.log_dir,
        "env": plan.user_env.as_dict(),
        "ranks": [
            {"rank": s.rank, "local_rank": s.local_rank, "argv": rank_argv(plan, s),
             "runtime": plan.injected, "env": rank_env(plan, node, s).to_json()}
            for s in (node.ranks if slots is None else slots)
        ],
    }
    if plan.user_env.expanded_keys():
        payload["env_files"] = [list(pair) for pair in plan.user_env.files]
    return payload


class AgentChannel(ABC):
    """One running agent: a byte stream each way plus a hard stop."""

    host: str
    #: Whether the link can go silent without closing (a network between
    #: launcher and agent): only such agents exchange heartbeats. A local
    #: child's pipe closes when the launcher dies, and a launcher stopped
    #: with Ctrl-Z is not lost.
    watched: bool = True

    @abstractmethod
    def stdin(self) -> IO[bytes]: ...

    @abstractmethod
    def stdout(self) -> IO[bytes]: ...

    @abstractmethod
    def kill(self) -> None:
        """Tear the agent down without its cooperation."""

    @abstractmethod
    def wait(self, timeout: float | None = None) -> int | None:
        """Exit status of the agent, or None if unknown / still running."""

    def exit_signal(self) -> int | None:
        """The signal the agent died of, where the transport tells (SSH)."""
        return None

    def on_eof(self) -> None:  # noqa: B027 - only some channels track it
        """Called once the agent's output has ended."""

    def on_done(self) -> None:  # noqa: B027 - only some channels track it
        """Called when the agent said ``done``: its ranks' stop is over."""

    def end_input(self) -> None:
        """End of the agent's input: it stops its ranks and exits."""
        try:
            self.stdin().close()
        except (OSError, EOFError, ValueError):
            pass

    def stderr(self) -> IO[bytes] | None:
        """The agent's stderr when the launcher must relay it (None: inherited)."""
        return None

    def exit_reason(self, code: int | None, err_tail: Sequence[str]) -> str:
        """Why the agent went away before saying ``done``: the signal it died
        of where the transport tells, else :meth:`exit_message`."""
        sig = self.exit_signal()
        if sig is not None:
            return f"node agent on {self.host} killed by {signal_name(sig)}"
        return self.exit_message(code, err_tail)

    def exit_message(self, code: int | None, err_tail: Sequence[str]) -> str:
        """Why the agent went away, from its exit status and the last lines
        its host printed (``err_tail``: stdout text that was no message, and
        stderr)."""
        message = f"node agent on {self.host} exited unexpectedly (status {code})"
        last = last_line(err_tail)
        return f"{message}: {last}" if last else message

    def close(self) -> None:  # noqa: B027 - most channels hold nothing to release
        """Release the transport once the agent is gone (or given up on)."""


class JobHandle:
    """The launcher's view of a running job: agents and their events.

    Besides the agents' own messages, the queue carries ``eof`` when an
    agent's output ends, ``agent_err`` for each line an agent writes on a
    relayed stderr and ``garbage`` for each stdout line that is no message;
    the last of both are kept in ``tails`` for error messages.
    ``leaders[n]`` is the channel of node n's first agent (the one probed).
    """

    def __init__(self, channels: list[AgentChannel],
                 leaders: Sequence[int] | None = None) -> None:
        self.channels = channels
        self.leaders = list(range(len(channels)) if leaders is None else leaders)
        self.events: queue.Queue[tuple[int, dict[str, Any]]] = queue.Queue()
        self.tails: list[collections.deque[str]] = [
            collections.deque(maxlen=STDERR_TAIL) for _ in channels]
        now = time.monotonic()
        self.last_seen = [now] * len(channels)
        self._locks = [threading.Lock() for _ in channels]
        self._beating = threading.Event()
        self._beater: threading.Thread | None = None
        self._hb_timeout = 0.0
        self._stderr_pumps: dict[int, threading.Thread] = {}
        for index, channel in enumerate(channels):
            err = channel.stderr()
            if err is not None:
                t = threading.Thread(target=self._pump_err, args=(index, err), daemon=True)
                t.start()
                self._stderr_pumps[index] = t
            threading.Thread(target=self._pump, args=(index, channel), daemon=True).start()

    @property
    def hosts(self) -> list[str]:
        return [c.host for c in self.channels]

    def start(self, request: Request) -> None:
        """Send each agent its start payload: from here on ranks run."""
        for index, payload in enumerate(request.payloads):
            self.send(index, payload)

    def send(self, index: int, obj: dict[str, Any]) -> None:
        with self._locks[index]:
            self._send(self.channels[index], obj)

    def send_all(self, obj: dict[str, Any], only: Iterable[int] | None = None) -> None:
        for index in range(len(self.channels)) if only is None else only:
            self.send(index, obj)

    @property
    def watched(self) -> list[int]:
        """Channels that exchange heartbeats (AgentChannel.watched)."""
        return [i for i, c in enumerate(self.channels) if c.watched]

    def start_heartbeats(self, timeout: float) -> None:
        """Tell every agent the heartbeat timeout (0 to those not watched),
        then beat every timeout/4 seconds until :meth:`close` (0: off)."""
        self._hb_timeout = timeout
        watched = set(self.watched)
        for index in range(len(self.channels)):
            self.send(index, {"cmd": "hb", "timeout": timeout if index in watched else 0})
        if timeout > 0 and watched and self._beater is None:
            self._beater = threading.Thread(target=self._beat, daemon=True,
                                            name="dsrun-heartbeat")
            self._beater.start()

    def _beat(self) -> None:
        while not self._beating.wait(self._hb_timeout / 4 or 1.0):
            if self._hb_timeout > 0:
                self.send_all({"cmd": "hb", "timeout": self._hb_timeout}, only=self.watched)

    def pause_heartbeats(self) -> None:
        """Before the launcher stops (Ctrl-Z): agents stop expecting heartbeats.
        Called from a signal handler: a channel busy in another write is skipped."""
        for index in self.watched:
            if self._locks[index].acquire(timeout=0.5):
                try:
                    self._send(self.channels[index], {"cmd": "hb", "timeout": 0})
                finally:
                    self._locks[index].release()

    def resume_heartbeats(self) -> None:
        """After the launcher continues: heartbeats as before the pause."""
        self.last_seen = [time.monotonic()] * len(self.channels)
        self.start_heartbeats(self._hb_timeout)

    def _pump(self, index: int, channel: AgentChannel) -> None:
        stream = channel.stdout()
        synced = False  # a message was read: nothing glued to one from here on
        try:
            for line in iter(stream.readline, b""):
                now = time.monotonic()
                self.last_seen[index] = now
                try:
                    msg = protocol.decode(line)
                except ValueError:
                    glued = None if synced else split_glued(line)
                    if glued is None:
                        self._garbage(index, line.decode("utf-8", "replace").rstrip(), now)
                        continue
                    self._garbage(index, glued[0].rstrip(), now)
                    msg = glued[1]
                synced = True
                msg["_recv"] = now
                if msg.get("ev") == "done":
                    channel.on_done()
                self.events.put((index, msg))
        except (OSError, EOFError, ValueError):
            pass  # transport gone: same as end of output
        channel.on_eof()
        err_pump = self._stderr_pumps.get(index)
        if err_pump is not None:  # its last lines explain an exit
            err_pump.join(timeout=0.5)
        self.events.put((index, {"ev": "eof", "_recv": time.monotonic()}))

    def _garbage(self, index: int, line: str, now: float) -> None:
        """A stdout line that is no message (a login shell's or a forced
        command's text): shown, and kept for the messages about the agent."""
        self.tails[index].append(line)
        self.events.put((index, {"ev": "garbage", "line": line, "_recv": now}))

    def _pump_err(self, index: int, stream: IO[bytes]) -> None:
        try:
            for raw in iter(stream.readline, b""):
                line = raw.decode("utf-8", "replace").rstrip("\n")
                self.tails[index].append(line)
                self.events.put((index, {"ev": "agent_err", "line": line}))
        except (OSError, EOFError, ValueError):
            pass

    def exit_message(self, index: int, code: int | None) -> str:
        return self.channels[index].exit_reason(code, tuple(self.tails[index]))

    def printed(self, index: int) -> str:
        """`` (it printed: LAST LINES)``: what agent ``index``'s host printed
        besides messages (stdout and stderr), or an empty string."""
        lines = [ln.strip() for ln in self.tails[index] if ln.strip()][-PRINTED_LINES:]
        return f" (it printed: {' | '.join(lines)})" if lines else ""

    @staticmethod
    def _send(channel: AgentChannel, obj: dict[str, Any]) -> None:
        try:
            protocol.write(channel.stdin(), obj)
        except (BrokenPipeError, OSError, ValueError, EOFError):
            pass  # the agent is gone; its eof event reports it

    def stop(self, interrupt: bool = False) -> None:
        """Ask every agent to stop its ranks (SIGTERM - SIGINT when
        ``interrupt`` - then the grace, then SIGKILL)."""
        self.send_all({"cmd": "stop", "signal": "SIGINT"} if interrupt else {"cmd": "stop"})

    def kill(self) -> None:
        for channel in self.channels:
            channel.kill()

    def drop(self, index: int) -> None:
        """Give up on one agent (its host was lost): tear its transport down."""
        self.channels[index].kill()

    def close(self, timeout: float = 5.0) -> None:
        """End of input for every agent (stop now), then wait for all of
        them at once: N hung hosts take ``timeout`` seconds, not N times it."""
        self._beating.set()
        for index, channel in enumerate(self.channels):
            with self._locks[index]:
                channel.end_input()
        threads = [threading.Thread(target=_wait_and_close, args=(c, timeout), daemon=True)
                   for c in self.channels]
        for t in threads:
            t.start()
        for t in threads:
            t.join()


#: How many of an agent's last lines a "did not answer" message quotes.
PRINTED_LINES = 3
_DECODER = json.JSONDecoder()


def last_line(lines: Sequence[str]) -> str:
    """The last non-blank line of ``lines``, stripped (empty if none)."""
    return next((ln.strip() for ln in reversed(lines) if ln.strip()), "")


def split_glued(line: bytes) -> tuple[str, dict[str, Any]] | None:
    """``(text, message)`` when ``line`` is text without a newline followed
    by a whole protocol message (an object with ``ev``) up to its end, as
    when a login shell prints ``Welcome`` with no newline before the agent
    starts; else None. The message is the first (outermost) object that
    decodes to the end of the line, so braces in the text do not matter."""
    text = line.decode("utf-8", "replace").rstrip("\r\n")
    start = text.find('{"', 1) if text.endswith("}") else -1
    while start > 0:
        try:
            obj, end = _DECODER.raw_decode(text, start)
        except ValueError:
            obj, end = None, -1
        if end == len(text) and isinstance(obj, dict) and "ev" in obj:
            return text[:start], obj
        start = text.find('{"', start + 1)
    return None


def _wait_and_close(channel: AgentChannel, timeout: float) -> None:
    channel.wait(timeout=timeout)
    channel.close()


class Backend(ABC):
    name: ClassVar[str]
    #: One agent per rank (mpirun/srun start every rank) instead of per host.
    agent_per_rank: ClassVar[bool] = False
    #: Agents on other hosts start in the host's login environment.
    login_env: ClassVar[bool] = False
    #: Only reaches hosts a hostfile names: without one the job is this
    #: host's, started as any job on this host is (DeepSpeed's pdsh runner).
    hostfile_only: ClassVar[bool] = False

    def __init__(self, hosts: HostsSpec | None = None, python: str = sys.executable) -> None:
        self.hosts = hosts or HostsSpec()
        self.python = python

    def agent_argv(self) -> tuple[str, ...]:
        return (self.python, "-m", AGENT_MODULE)

    def remote_path(self) -> tuple[str, ...]:
        """PATH prefix for ranks on other hosts (see :attr:`login_env`)."""
        return (os.path.dirname(self.python),) if self.login_env else ()

    def pool_without_hostfile(self) -> HostPool | None:
        """The hosts to choose from when no hostfile exists (None: this host)."""
        return None

    def local_hosts(self, hosts: Sequence[str], hostname: str,
                    addresses: Sequence[str]) -> list[bool]:
        """Which of ``hosts`` are this machine."""
        return [is_local_host(h, hostname, addresses) for h in hosts]

    def check(self, cluster: Cluster) -> None:  # noqa: B027 - nothing to check by default
        """Refuse, before anything starts, a job this backend cannot run."""

    def connect_address(self, host: str) -> str | None:
        """The address the launcher reaches ``host`` at, when it knows one."""
        return None

    @abstractmethod
    def prepare(self, plan: LaunchPlan) -> Request:
        """The printable request for ``plan`` (pure)."""

    @abstractmethod
    def open(self, plan: LaunchPlan, sink: OutputSink,
             on_connect: ConnectSink = ignore_connect) -> JobHandle:
        """Start the agents of ``plan`` (a draft will do), each waiting for
        its first line. ``sink`` receives what a launching tool prints;
        ``on_connect`` each host name as its agent is up."""
