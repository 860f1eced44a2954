"""Agents started by one command (mpirun, srun) that connect back.

:func:`open_connected` is ``open`` for such backends: it listens on a free
port, starts the launching tool with the callback variables in its
environment (protocol.py), waits until one agent per rank has connected
and proved it knows the job secret (callback.py), checks that the tool
placed the ranks where the plan has them, and returns a
:class:`ConnectedHandle` whose channels are the connections, in rank order.

The tool is supervised with the agents: its output goes to the sink as
``[mpirun]``/``[srun]`` lines (and its last lines explain a failure), it
may not exit before every agent has connected, and closing the handle
waits for it to exit, then SIGTERMs and finally SIGKILLs it (mpirun, which
a SIGTERM only puts to sleep, is SIGKILLed at once, and the agents it
leaves on this host after it: tool_stop.py). An agent that
loses its connection stops its ranks, so nothing of the job outlives the
launcher on any host.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import IO, Any

from dsrun.errors import LaunchError
from dsrun.launcher import callback, netinfo, protocol
from dsrun.launcher.backends import tool_stop
from dsrun.launcher.backends.base import (
    TOOL_LINE,
    AgentChannel,
    ConnectSink,
    JobHandle,
    OutputSink,
    ignore_connect,
)
from dsrun.launcher.backends.tool_output import (  # noqa: F401 - importable here too
    BOX_QUOTE,
    FORCED,
    TOOL_TAIL,
    ToolOutput,
)
from dsrun.launcher.plan import LaunchPlan

log = logging.getLogger("dsrun.launcher")
#: Seconds the tool gets to exit after its agents have, before SIGTERM.
TOOL_EXIT_GRACE = 10.0


class LaunchTool:
    """The process that starts the agents (mpirun, srun), with its output."""

    def __init__(self, name: str, argv: Sequence[str], env: Mapping[str, str], cwd: str,
                 sink: OutputSink, executable: str | None = None,
                 advice: Callable[[str], str] | None = None,
                 after_kill: Callable[[int], None] | None = None,
                 secret: str | None = None) -> None:
        """``executable``: the file to run, when ``argv[0]`` is only the name
        it runs under (mpirun must not see its absolute path: openmpi.py);
        ``advice``: the backend's fix for the failure its output summary
        says (or ""), added to :meth:`exit_text`; ``after_kill``: removes
        what the tool, SIGKILLed by :meth:`stop`, left behind (its pid);
        ``secret``: the agents' callback secret when a SIGTERM does not
        help (mpirun): :meth:`stop` then SIGKILLs the tool at once and the
        agents it leaves on this host after it (tool_stop.py)."""
        self.name = name
        self.sink = sink
        self.advice = advice
        self.after_kill = after_kill
        self.secret = secret
        self.killed = False  # SIGKILLed by dsrun (kill, stop)
        self.output = ToolOutput()
        try:
            # Own session: Ctrl-C reaches the launcher, which stops the job in order.
            self.proc = subprocess.Popen(list(argv), executable=executable, env=dict(env),
                                         cwd=cwd, stdin=subprocess.DEVNULL,
                                         stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                         start_new_session=True)
        except OSError as exc:
            raise LaunchError(f"cannot start {executable or argv[0]}: "
                              f"{exc.strerror or exc}") from None
        self._pumps = [threading.Thread(target=self._pump, args=(fd, stream), daemon=True)
                       for fd, stream in ((1, self.proc.stdout), (2, self.proc.stderr))]
        for t in self._pumps:
            t.start()

    def _pump(self, fd: int, stream: IO[bytes]) -> None:
        for raw in iter(stream.readline, b""):
            line = raw.decode("utf-8", "replace").rstrip("\n")
            self.output.add(line, fd)
            self.sink(self.name, TOOL_LINE, fd, line)
        stream.close()

    def alive(self) -> bool:
        return self.proc.poll() is None

    def exit_text(self, when: str = "") -> str:
        """'mpirun exited with status 1 <when>: <its last error line>'."""
        for t in self._pumps:
            t.join(timeout=1)
        last = self.output.summary()
        text = f"{self.name} exited with status {self.proc.returncode}{when}"
        fix = self.advice(last) if self.advice is not None and last else ""
        return f"{text}: {last}{f'; {fix}' if fix else ''}" if last else text

    def kill(self) -> None:
        """SIGKILL it now; :meth:`stop` reaps it and cleans up after it."""
        self.killed = True
        self.proc.kill()

    def stop(self, grace: float, term_wait: float = 5.0, early: bool = False) -> None:
        """Wait ``grace`` seconds for it to exit, then SIGTERM, then SIGKILL
        ``term_wait`` seconds later; with a ``secret``, SIGKILL it after
        ``grace`` (or, ``early``, once no agent is left on this host), then
        the agents it leaves here."""
        if self.secret is not None:
            if not tool_stop.wait_exit(self.proc, grace, self.secret if early else None):
                self.kill()
            self.proc.wait()
            if self.killed:
                tool_stop.kill_agents(self.secret)
        elif not tool_stop.wait_exit(self.proc, grace):
            self.proc.terminate()
            if not tool_stop.wait_exit(self.proc, term_wait):
                self.kill()
            self.proc.wait()
        after, self.after_kill = self.after_kill, None
        if after is not None and self.killed and self.proc.returncode == -signal.SIGKILL:
            after(self.proc.pid)  # reaped just now: its pid is no one else's yet


class SocketChannel(AgentChannel):
    """An agent's connection back to the launcher."""

    def __init__(self, sock: socket.socket, hello: dict[str, Any], tool: LaunchTool) -> None:
        self.sock = sock
        self.hello = hello
        self.host = str(hello.get("host") or "?")
        self.rank = int(hello["rank"])
        self.tool = tool
        self._in = sock.makefile("wb")
        self._out = sock.makefile("rb")
        self._eof = threading.Event()
        self.confirmed = False  # the agent said done (not only: its link ended)

    def on_done(self) -> None:
        self.confirmed = True

    def stdin(self) -> IO[bytes]:
        return self._in  # type: ignore[return-value]

    def stdout(self) -> IO[bytes]:
        return self._out  # type: ignore[return-value]

    def on_eof(self) -> None:
        self._eof.set()

    def end_input(self) -> None:
        try:
            self._in.flush()
            self.sock.shutdown(socket.SHUT_WR)
        except (OSError, ValueError):
            pass

    def kill(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def wait(self, timeout: float | None = None) -> int | None:
        return 0 if self._eof.wait(timeout) else None

    def exit_message(self, code: int | None, err_tail: Sequence[str]) -> str:
        message = f"lost the connection to the agent of rank {self.rank} on {self.host}"
        if not self.tool.alive():
            message += f" ({self.tool.exit_text()})"
        elif self.tool.output.forced is not None:  # srun still waits for its step's end
            message += (f" ({self.tool.name} got a signal of its own and killed every task "
                        f"of its step: {self.tool.output.forced})")
        return message

    def close(self) -> None:
        for f in (self._in, self._out):
            try:
                f.close()
            except (OSError, ValueError):
                pass
        self.sock.close()


class _Closed(Exception):
    """An agent finished its handshake after the server was closed."""


class CallbackServer:
    """Listens for the agents of one attempt and authenticates them."""

    def __init__(self, expected: int, on_connect: ConnectSink = ignore_connect) -> None:
        self.expected = expected
        self.on_connect = on_connect
        self.secret = callback.new_secret()
        self.sock = _listen()
        self.port = int(self.sock.getsockname()[1])
        self.hellos: dict[int, tuple[socket.socket, dict[str, Any]]] = {}
        self.problems: list[str] = []
        self.cond = threading.Condition()
        self._closed = False
        threading.Thread(target=self._accept, daemon=True, name="dsrun-callback").start()

    def _accept(self) -> None:
        while True:
            try:
                conn, peer = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._handshake, args=(conn, peer), daemon=True).start()

    def _handshake(self, conn: socket.socket, peer: Any) -> None:
        try:
            hello = callback.server_handshake(conn, self.secret)
            rank = hello["rank"]
            with self.cond:
                if self._closed:
                    raise _Closed()
                if not 0 <= rank < self.expected or rank in self.hellos:
                    raise callback.HandshakeError(f"unexpected rank {rank}")
                self.hellos[rank] = (conn, hello)
                self.cond.notify_all()
            self.on_connect(str(hello.get("host") or "?"))
        except (_Closed, callback.HandshakeError, OSError) as exc:
            conn.close()
            with self.cond:
                closed = self._closed
                if not closed:
                    self.problems.append(f"{peer}: {exc}")
            if closed:
                # The start was given up (Ctrl-C, mpirun exited, a timeout) while
                # this agent connected: closing its connection stops it; the
                # launcher says why the job stopped.
                log.debug("agent connection from %s closed: the job is stopping", peer)
            else:
                log.warning("refused an agent connection from %s: %s", peer, exc)

    def wait_all(self, tool: LaunchTool, timeout: float | None) -> None:
        """Until every rank's agent has connected; LaunchError if the tool
        exits first or ``timeout`` passes."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self.cond:
            while len(self.hellos) < self.expected:
                if not tool.alive():
                    raise LaunchError(tool.exit_text(f" before {self._missing()} "
                                                     f"connected back"))
                if deadline is not None and time.monotonic() > deadline:
                    raise LaunchError(f"{self._missing()} did not connect back within "
                                      f"{timeout:g}s of starting {tool.name}")
                self.cond.wait(0.1)

    def _missing(self) -> str:
        missing = [r for r in range(self.expected) if r not in self.hellos]
        shown = ",".join(map(str, missing[:8])) + ("..." if len(missing) > 8 else "")
        return f"the agents of rank(s) {shown}"

    def endpoints(self, prefer: Sequence[str]) -> str:
        """The addresses agents try, in order: ``prefer`` (routes to the job's
        hosts), this host's other addresses, loopback last."""
        own = [a.split("%")[0] for a in netinfo.own_addresses()]
        routed = [a for a in prefer if a]
        others = [a for a in own if not netinfo.is_loopback(a) and a not in routed
                  and not a.startswith("fe80")]
        return callback.format_endpoints([*dict.fromkeys([*routed, *others]), "127.0.0.1"],
                                         self.port)

    def close(self, keep: bool, listen: bool = False) -> None:
        """Stop listening (``listen``: go on accepting, only to close each
        late agent's connection: it then exits at once, where a refused one
        dials again until its timeout); close the agents' connections
        unless ``keep``."""
        with self.cond:
            self._closed = True
            conns = [] if keep else [c for c, _ in self.hellos.values()]
        if not listen:
            try:
                self.sock.close()
            except OSError:
                pass
        for conn in conns:
            conn.close()


def _listen() -> socket.socket:
    try:
        sock = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
        sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        sock.bind(("::", 0))
    except OSError:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind(("0.0.0.0", 0))
    sock.listen(1024)
    return sock


def same_host_name(a: str, b: str) -> bool:
    """Whether two host names name one machine: equal (case aside), or a
    short name and its fully qualified form (pure; no DNS)."""
    a, b = a.lower().rstrip("."), b.lower().rstrip(".")
    return a == b or a == b.split(".")[0] or b == a.split(".")[0]


def _off_plan(plan: LaunchPlan, index: int, got: str, here: str | None) -> bool:
    """Whether the agents of node ``index`` report a host that is not its
    plan host, as far as names tell: this host's node must report this
    host's name (``here``), another node must not report it, nor the name
    of another node of the plan (an address or ssh alias in the hostfile
    is not compared: it may name the reported host)."""
    node = plan.nodes[index]
    if here is not None:
        if node.local != same_host_name(got, here) and (
                node.local or any(n.local for n in plan.nodes)):
            return True
    return not same_host_name(got, node.host) and any(
        same_host_name(got, other.host) for other in plan.nodes if other is not node)


def placement_problem(plan: LaunchPlan, hellos: Mapping[int, Mapping[str, Any]],
                      tool: str, here: str | None = None,
                      options: str | None = None) -> str | None:
    """Why the tool's placement differs from the plan's, or None (pure).

    Every rank must have the plan's local rank, the ranks of one node must
    share a host, that host must be the plan's (:func:`_off_plan`; ``here``:
    this host's name), and different nodes must be different hosts.
    ``options``: the user's options to the tool (``--launcher_args``), named
    in the error as what may have moved the ranks.
    """
    why = f" (options in {options} must not change where ranks run)" if options else ""
    seen: dict[str, int] = {}
    for index, node in enumerate(plan.nodes):
        host = str(hellos[node.ranks[0].rank].get("host"))
        planned = f"{node.host} (this host)" if node.local else node.host
        for slot in node.ranks:
            got = hellos[slot.rank]
            if got.get("local_rank") != slot.local_rank or str(got.get("host")) != host \
                    or _off_plan(plan, index, host, here):
                return (f"{tool} started rank {slot.rank} as local rank {got.get('local_rank')}"
                        f" on {got.get('host')}, but dsrun's plan has it as local rank "
                        f"{slot.local_rank} on {planned}{why}")
        if host in seen:
            return (f"{tool} started ranks of hosts {plan.nodes[seen[host]].host} and "
                    f"{node.host} on the same host {host}{why}")
        seen[host] = node.node_rank
    return None


class ConnectedHandle(JobHandle):
    """A JobHandle over connect-back channels, owning the launching tool."""

    def __init__(self, channels: list[AgentChannel], leaders: Sequence[int],
                 tool: LaunchTool, grace: float,
                 ended_wait: tuple[float, float] | None = None) -> None:
        """``ended_wait``: seconds the tool gets to exit when every agent's
        connection ended, and then after a SIGTERM - for a tool that is
        SIGKILLed at once (``LaunchTool.secret``), only when every agent also
        said ``done``. Otherwise (None, or an agent was lost: it may still be
        stopping its ranks) ``grace`` + TOOL_EXIT_GRACE, and 5 s; a tool with
        a ``secret`` is SIGKILLed as soon as none of its agents is left here."""
        super().__init__(channels, leaders)
        self.tool = tool
        self.grace = grace
        self.ended_wait = ended_wait

    def kill(self) -> None:
        super().kill()
        if self.tool.alive():
            self.tool.kill()

    def close(self, timeout: float = 5.0) -> None:
        super().close(timeout)
        ended = all(c.wait(0) is not None for c in self.channels)
        confirmed = all(getattr(c, "confirmed", False) for c in self.channels)
        if self.ended_wait is not None and ended and (confirmed or self.tool.secret is None):
            self.tool.stop(*self.ended_wait)
        else:  # a lost agent may still be stopping its ranks
            self.tool.stop(self.grace + TOOL_EXIT_GRACE, early=True)


def open_connected(plan: LaunchPlan, name: str, argv: Sequence[str],
                   tool_env: Mapping[str, str], sink: OutputSink, prefer: Sequence[str],
                   timeout: float | None, agent_timeout: float,
                   on_connect: ConnectSink = ignore_connect,
                   executable: str | None = None,
                   advice: Callable[[str], str] | None = None,
                   options: str | None = None,
                   after_kill: Callable[[int], None] | None = None,
                   ended_wait: tuple[float, float] | None = None,
                   kill_agents: bool = False) -> ConnectedHandle:
    """Start ``argv`` (the tool; ``executable``: the file, when ``argv[0]``
    is only its name; ``advice``, ``after_kill``: see :class:`LaunchTool`) and wait for
    every rank's agent; see the module docstring. ``tool_env`` is the tool's
    environment without the callback variables, which are added here;
    ``agent_timeout`` is how long an agent tries to reach the launcher;
    ``ended_wait``: see :class:`ConnectedHandle`; ``kill_agents``: the
    tool is SIGKILLed, not SIGTERMed, and the agents it leaves here after it
    (``secret`` of :class:`LaunchTool`);
    ``options``: the user's options to the tool, if any (for errors)."""
    server = CallbackServer(plan.world_size, on_connect)
    env = {**tool_env, protocol.LAUNCHER_VAR: server.endpoints(prefer),
           protocol.SECRET_VAR: server.secret, protocol.TIMEOUT_VAR: f"{agent_timeout:g}"}
    tool = None
    try:
        tool = LaunchTool(name, argv, env, plan.cwd, sink, executable, advice, after_kill,
                          server.secret if kill_agents else None)
        server.wait_all(tool, timeout)
        hellos = {r: h for r, (_, h) in server.hellos.items()}
        problem = placement_problem(plan, hellos, name, socket.gethostname(), options)
        if problem:
            raise LaunchError(problem)
    except BaseException:
        server.close(keep=False, listen=True)  # until the tool and its agents are gone
        try:
            if tool is not None:
                tool.stop(0)
        finally:
            server.close(keep=False)
        raise
    server.close(keep=True)
    channels: list[AgentChannel] = [SocketChannel(*server.hellos[r], tool)
                                    for r in range(plan.world_size)]
    leaders = [node.ranks[0].rank for node in plan.nodes]
    return ConnectedHandle(channels, leaders, tool, plan.kill_grace, ended_wait)


def tool_environment(plan: LaunchPlan, base: Mapping[str, str] | None = None) -> dict[str, str]:
    """The tool's environment: the launcher's, plus the user's variables (so
    that ``-x NAME`` / ``--export`` pass them on by name), less the env-file
    values the agents expand on their hosts (``UserEnv.passed_as_is``)."""
    env = dict(os.environ if base is None else base)
    env.update(plan.user_env.passed_as_is())
    return env
