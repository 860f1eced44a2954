"""SSH backend: a node agent per host over paramiko; this host's agent locally.

One connection per remote host, opened in parallel threads; on it one exec
channel (no pty) runs ``cd CWD || exit 96; exec [env PYTHONPATH=...] PYTHON -m
dsrun.launcher.agent`` (as bytes: a path that is not UTF-8 goes as it is)
with the launcher's own interpreter, working directory and (the one value
on a command line: a path list, as DeepSpeed's pdsh runner sends it) the
PYTHONPATH the ranks get (agent_env.py). The agent gets the
probe commands and then its start payload (with every other environment
value) on the channel's stdin, never on a command line. Hosts that are
this machine (localhost, its names and addresses) get a local child agent
instead, as with the local backend.

Where to connect comes from ssh_config (ssh_connect.py lists the keys read;
ProxyJump/ProxyCommand and Include too), overridden by ``--ssh_port``,
``--ssh_user``, ``--ssh_key``; the default user is this uid's login name,
as for ssh. Host keys are checked against the known_hosts
files (under the HostKeyAlias, else the HostName, else, when that has no
entry, the hostfile's name for the host); an unknown
key is refused with the command that fixes it, unless ``--ssh_insecure``
(or StrictHostKeyChecking no/accept-new) is given; keys are never saved.

Stopping: SSH cannot deliver signals. Closing the channel's stdin, closing
the connection, or the launcher dying (its TCP connection closes, so sshd
closes the session's pipes) all end the remote agent's stdin, and the agent
treats that as "stop now" and tears its ranks down.
"""

from __future__ import annotations

import functools
import io
import logging
import os
import shlex
import signal
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import IO

import paramiko

from dsrun.errors import DsrunUsageError
from dsrun.launcher.backends.agent_env import local_agent_env, remote_assignments
from dsrun.launcher.backends.base import (
    AGENT_MODULE,
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
from dsrun.launcher.backends.local import LocalChannel, local_request
from dsrun.launcher.backends.ssh_connect import (
    Lookup,
    SshConnectError,
    SshTarget,
    config_lookup,
    connect,
    default_user,
    resolve_target,
)
from dsrun.launcher.netinfo import is_local_host
from dsrun.launcher.plan import LaunchPlan
from dsrun.launcher.spec import HostsSpec

# paramiko logs handshake failures with tracebacks; dsrun reports them itself.
logging.getLogger("paramiko").addHandler(logging.NullHandler())

#: Exit status of the remote command when the working directory is missing.
CWD_MISSING = 96


def remote_command(python: str, cwd: str, env_words: str | None = None) -> str:
    """The line sshd runs (through the login shell): cd, then the agent.

    ``env_words``: shell assignments for the agent (agent_env.py: the ranks'
    PYTHONPATH), through ``env``, or as the assignments before ``exec``
    where the interpreter's path has a ``=`` (``env`` would take it for one
    more assignment). POSIX shell syntax, as for the ``cd``: the login shell
    must be a POSIX one (sh, bash, dash, ksh, zsh), not csh or fish."""
    q = shlex.quote
    if not env_words:
        run = f"exec {q(python)}"
    elif "=" in python:
        run = f"{env_words} exec {q(python)}"
    else:
        run = f"exec env {env_words} {q(python)}"
    return f"cd {q(cwd)} || exit {CWD_MISSING}; {run} -m {AGENT_MODULE}"


def command_bytes(command: str) -> bytes:
    """The remote command as the bytes sshd gets: a path that is not UTF-8
    (the working directory, a PYTHONPATH entry: Python holds its bytes as
    surrogates) goes as the same bytes, as a shell here would send it
    (paramiko would encode the str as strict UTF-8 and fail)."""
    return command.encode("utf-8", "surrogateescape")


# --------------------------------------------------------------------------
# exit signals: sshd reports a command killed by a signal with an
# "exit-signal" request (RFC 4254 6.10), which paramiko does not read (its
# exit_status stays -1). A handler in front of paramiko's records it.

#: Attribute of a paramiko Channel: the signal name ("KILL") its command died of.
EXIT_SIGNAL_ATTR = "dsrun_exit_signal"


def _channel_request(chan: paramiko.Channel, m: paramiko.Message) -> None:
    start = m.packet.tell()
    try:
        if m.get_text() == "exit-signal":
            m.get_boolean()  # want_reply: always false for exit-signal
            setattr(chan, EXIT_SIGNAL_ATTR, m.get_text())
    except Exception:  # noqa: BLE001 - a malformed request is paramiko's to judge
        pass
    m.packet.seek(start)
    paramiko.Channel._handle_request(chan, m)


def watch_exit_signals(transport: paramiko.Transport) -> None:
    """Record exit-signal requests on this transport's channels."""
    table = dict(transport._channel_handler_table)
    table[paramiko.common.MSG_CHANNEL_REQUEST] = _channel_request
    transport._channel_handler_table = table  # type: ignore[misc]


def signal_number(name: str | None) -> int | None:
    if not name:
        return None
    try:
        return int(signal.Signals[name if name.startswith("SIG") else f"SIG{name}"])
    except KeyError:
        return None


# --------------------------------------------------------------------------
# channels


class SshChannel(AgentChannel):
    """The agent on a remote host, on one exec channel of its own connection."""

    def __init__(self, target: SshTarget, client: paramiko.SSHClient, command: str,
                 cwd: str, python: str, connect_seconds: float = 0.0) -> None:
        self.host = target.host
        self.connect_seconds = connect_seconds
        self.target = target
        self.client = client
        self.cwd = cwd
        self.python = python
        transport = client.get_transport()
        assert transport is not None
        watch_exit_signals(transport)
        self.chan = transport.open_session(timeout=target.session_timeout or target.timeout)
        self.chan.exec_command(command_bytes(command))
        self._in = self.chan.makefile_stdin("wb")  # close() sends EOF
        self._out = self.chan.makefile("rb")
        self._err = self.chan.makefile_stderr("rb")

    def stdin(self) -> IO[bytes]:
        return self._in  # type: ignore[return-value]

    def stdout(self) -> IO[bytes]:
        return self._out  # type: ignore[return-value]

    def stderr(self) -> IO[bytes]:
        return self._err  # type: ignore[return-value]

    def kill(self) -> None:
        # No signals over SSH: dropping the connection ends the agent's stdin.
        self.client.close()

    def wait(self, timeout: float | None = None) -> int | None:
        if not self.chan.status_event.wait(timeout):
            return None
        # paramiko's -1: no exit-status came (a signal, or the connection ended)
        code = self.chan.exit_status
        return None if code < 0 else code

    def exit_signal(self) -> int | None:
        return signal_number(getattr(self.chan, EXIT_SIGNAL_ATTR, None))

    def exit_message(self, code: int | None, err_tail: Sequence[str]) -> str:
        last = next((ln.strip() for ln in reversed(err_tail) if ln.strip()), "")
        if code == CWD_MISSING:
            return f"working directory {self.cwd} does not exist on {self.host}"
        if code == 127:
            return f"python interpreter {self.python} not found on {self.host}"
        if code is None or code < 0:
            return f"lost the SSH connection to {self.host}"
        message = f"node agent on {self.host} exited unexpectedly (status {code})"
        if last:
            message += f": {last}"
        if "No module named" in last:
            message += (f" (is dsrun installed for {self.python} on {self.host}, or on the "
                        f"launcher's PYTHONPATH, which the agent gets?)")
        return message

    def close(self) -> None:
        # Closed here, not by their finalizers at interpreter exit, when
        # paramiko's buffers may already be gone ("Exception ignored" noise).
        # paramiko's close() flushes first and marks the file closed only
        # after that: a flush that raises (the channel or its buffer is
        # gone) left it open, and its __del__ flushed again, raising where
        # nobody catches. So whatever close() did, nothing is left to flush.
        for stream in (self._in, self._out, self._err):
            try:
                stream.close()
            except (OSError, ValueError, EOFError, paramiko.SSHException):
                pass
            finally:
                stream._wbuffer = _Flushed()  # type: ignore[union-attr]
                stream._closed = True  # type: ignore[union-attr]
        self.client.close()


class _Flushed:
    """A paramiko file's write buffer after close: always empty (no
    finalizer of its own, unlike the BytesIO it replaces)."""

    def getvalue(self) -> bytes:
        return b""


class FailedChannel(AgentChannel):
    """A host that could not be reached: no output, and the reason."""

    def __init__(self, host: str, message: str) -> None:
        self.host = host
        self.message = message
        self._in = io.BytesIO()

    def stdin(self) -> IO[bytes]:
        return self._in

    def stdout(self) -> IO[bytes]:
        return io.BytesIO()

    def kill(self) -> None:
        pass

    def wait(self, timeout: float | None = None) -> int | None:
        return 255

    def exit_message(self, code: int | None, err_tail: Sequence[str]) -> str:
        return self.message


# --------------------------------------------------------------------------
# the backend


class SshBackend(Backend):
    name = "ssh"
    login_env = True
    hostfile_only = True

    def __init__(self, hosts: HostsSpec | None = None, python: str = sys.executable,
                 lookup: Lookup | None = None, user: str | None = None,
                 environ: Mapping[str, str] | None = None) -> None:
        super().__init__(hosts, python)
        self.options = self.hosts.ssh
        self._lookup = lookup
        self._user = user
        self._targets: dict[str, SshTarget] = {}
        self.environ = dict(os.environ if environ is None else environ)

    def target(self, host: str) -> SshTarget:
        if host not in self._targets:
            if self._lookup is None:
                self._lookup = config_lookup(self.options.config)
            user = self._user or default_user()
            self._targets[host] = resolve_target(host, self.options, self._lookup(host), user,
                                                 self._lookup)
        return self._targets[host]

    def local_hosts(self, hosts: Sequence[str], hostname: str,
                    addresses: Sequence[str]) -> list[bool]:
        """This machine, also by its ssh_config HostName. A host reached
        through ProxyJump/ProxyCommand never is: its names mean what they
        mean beyond the proxy (a LAN range that the cluster's also uses,
        127.0.0.1 or localhost being the jump host itself)."""
        return [not self.target(h).proxied and
                is_local_host(h, hostname, addresses, self.target(h).hostname)
                for h in hosts]

    def connect_address(self, host: str) -> str | None:
        return self.target(host).hostname

    def prepare(self, plan: LaunchPlan) -> Request:
        agents = []
        for i, node in enumerate(plan.nodes):
            if node.local:
                agents.append(local_request(self, plan, i, self.environ))
                continue
            command = remote_command(self.python, plan.cwd,
                                     remote_assignments(plan.user_env, shown=True))
            start = f"{self.target(node.host).describe()}: {command}"
            agents.append(AgentRequest(node.host, agent_payload(plan, node), start,
                                       f"the login environment of {node.host}"))
        return Request(self.name, plan, tuple(agents))

    def open(self, plan: LaunchPlan, sink: OutputSink,
             on_connect: ConnectSink = ignore_connect) -> JobHandle:
        """Connect to every host in parallel and start its agent.

        A host that cannot be reached gets a FailedChannel (its ``eof``
        carries the reason); if the launcher is interrupted meanwhile, every
        connection, also those still being made, is closed.
        """
        local_env = local_agent_env(plan.user_env, os.environ)
        words = remote_assignments(plan.user_env)
        opens = [functools.partial(self._open_one, n.host, plan.cwd, n.local,
                                   local_env if n.local else words) for n in plan.nodes]
        return JobHandle(connect_all([n.host for n in plan.nodes], opens, on_connect))

    def _open_one(self, host: str, cwd: str, is_local: bool,
                  env: str | Mapping[str, str] | None = None) -> AgentChannel:
        """``env``: the local agent's environment, or the remote one's
        assignments (agent_env.py)."""
        if is_local:
            return LocalChannel(host, self.agent_argv(), cwd,
                                env if isinstance(env, Mapping) else None)
        try:
            target = self.target(host)
            start = time.monotonic()
            client = connect(target)
        except (SshConnectError, DsrunUsageError) as exc:
            return FailedChannel(host, str(exc))
        try:
            words = env if isinstance(env, str) else None
            return SshChannel(target, client, remote_command(self.python, cwd, words),
                              cwd, self.python, time.monotonic() - start)
        except (paramiko.SSHException, OSError, EOFError) as exc:
            client.close()
            return FailedChannel(host, f"{host}: cannot start a command over SSH: {exc}")


def connect_all(hosts: Sequence[str], opens: Sequence[Callable[[], AgentChannel]],
                on_connect: ConnectSink = ignore_connect) -> list[AgentChannel]:
    """``opens[i]()`` for every host at once, each in a daemon thread: the
    channels in host order. An exception from an opener or from
    ``on_connect`` is raised here once every thread has ended (the other
    channels closed); an interrupt while waiting closes every channel,
    also those still being made."""
    results: list[AgentChannel | BaseException | None] = [None] * len(hosts)
    lock = threading.Lock()
    finished = threading.Semaphore(0)
    abandoned = False

    def one(i: int) -> None:
        try:
            channel: AgentChannel | BaseException = opens[i]()
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            channel = exc
        try:
            with lock:
                results[i] = channel
                late = abandoned
            if isinstance(channel, AgentChannel):
                if late:  # the launcher gave up meanwhile: nothing may stay open
                    _discard(channel)
                elif not isinstance(channel, FailedChannel):
                    on_connect(hosts[i])
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            with lock:
                if isinstance(channel, AgentChannel):
                    _discard(channel)
                results[i] = exc
        finally:  # always: the launcher waits for every thread without a timeout
            finished.release()

    # Daemon threads, not a pool: a connect blocked on a silent host
    # (up to --ssh_timeout) must not hold the interpreter's exit after a
    # Ctrl-C (concurrent.futures joins its workers at exit).
    for i, host in enumerate(hosts):
        threading.Thread(target=one, args=(i,), name=f"dsrun-ssh-{host}", daemon=True).start()
    try:
        for _ in hosts:
            finished.acquire()
    except BaseException:
        with lock:
            abandoned = True
            opened = [c for c in results if isinstance(c, AgentChannel)]
        for channel in opened:
            _discard(channel)
        raise
    error = next((r for r in results if isinstance(r, BaseException)), None)
    if error is not None:
        for channel in results:
            if isinstance(channel, AgentChannel):
                _discard(channel)
        raise error
    return [c for c in results if isinstance(c, AgentChannel)]


def _discard(channel: AgentChannel) -> None:
    channel.end_input()
    channel.kill()
    channel.close()
