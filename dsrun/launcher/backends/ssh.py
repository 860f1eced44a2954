"""SSH backend: a node agent per host over paramiko; this host's agent locally.

One connection per remote host, opened in parallel threads; on it one exec
channel (no pty) runs ``cd CWD || exit 96; exec PYTHON -m
dsrun.launcher.agent`` with the launcher's own interpreter and working
directory. The agent gets the probe commands and then its start payload
(with every environment value) on the channel's stdin, never on a command
line. Hosts that are this machine (localhost, its names and addresses)
get a local child agent instead, as with the local backend.

Where to connect comes from ssh_config (paramiko.SSHConfig: HostName, Port,
User, IdentityFile, IdentitiesOnly, UserKnownHostsFile,
GlobalKnownHostsFile, StrictHostKeyChecking), overridden by ``--ssh_port``,
``--ssh_user``, ``--ssh_key``. Host keys are checked against the known_hosts
files (under the HostName, or the hostfile's name for the host); an unknown
key is refused with the command that fixes it, unless ``--ssh_insecure``
(or StrictHostKeyChecking no/accept-new) is given; keys are never saved.

Stopping: SSH cannot deliver signals. Closing the channel's stdin, closing
the connection, or the launcher dying (its TCP connection closes, so sshd
closes the session's pipes) all end the remote agent's stdin, and the agent
treats that as "stop now" and tears its ranks down.
"""

from __future__ import annotations

import getpass
import io
import logging
import os
import shlex
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import IO, Any

import paramiko

from dsrun.errors import DsrunUsageError, LaunchError
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
from dsrun.launcher.netinfo import is_local_host
from dsrun.launcher.plan import LaunchPlan
from dsrun.launcher.spec import HostsSpec, SshOptions

# paramiko logs handshake failures with tracebacks; dsrun reports them itself.
logging.getLogger("paramiko").addHandler(logging.NullHandler())

#: Exit status of the remote command when the working directory is missing.
CWD_MISSING = 96
SSH_PORT = 22
DEFAULT_CONFIG = "~/.ssh/config"
USER_KNOWN_HOSTS = ("~/.ssh/known_hosts", "~/.ssh/known_hosts2")
SYSTEM_KNOWN_HOSTS = ("/etc/ssh/ssh_known_hosts", "/etc/ssh/ssh_known_hosts2")

Lookup = Callable[[str], Mapping[str, Any]]


# --------------------------------------------------------------------------
# targets (pure)


@dataclass(frozen=True)
class SshTarget:
    """Everything needed to reach one host, resolved from options and config."""

    host: str  # as written in the hostfile
    hostname: str  # where to connect (ssh_config HostName)
    port: int
    user: str
    keys: tuple[str, ...]
    identities_only: bool
    known_hosts: tuple[str, ...]
    host_keys: str  # "strict" | "accept-new" | "off"
    timeout: float

    @property
    def address(self) -> str:
        host = f"[{self.hostname}]" if ":" in self.hostname else self.hostname
        return f"{host}:{self.port}"

    def describe(self) -> str:
        return f"ssh {self.user}@{self.address}"


def _host_key_mode(options: SshOptions, config: Mapping[str, Any]) -> str:
    if options.insecure:
        return "off"
    strict = str(config.get("stricthostkeychecking", "yes")).lower()
    return {"no": "off", "off": "off", "accept-new": "accept-new"}.get(strict, "strict")


def resolve_target(host: str, options: SshOptions, config: Mapping[str, Any],
                   default_user: str) -> SshTarget:
    """Where and how to connect to ``host``: flags win over ssh_config."""
    port_text = options.port if options.port is not None else config.get("port", SSH_PORT)
    try:
        port = int(port_text)
    except ValueError:
        raise DsrunUsageError(f"ssh config: bad Port {port_text!r} for host {host}") from None
    if options.key:
        keys: tuple[str, ...] = (os.path.expanduser(options.key),)
        only = True
    else:
        keys = tuple(os.path.expanduser(k) for k in config.get("identityfile", ()))
        only = str(config.get("identitiesonly", "no")).lower() == "yes"
    user_files = str(config.get("userknownhostsfile", "")).split() or list(USER_KNOWN_HOSTS)
    global_files = str(config.get("globalknownhostsfile", "")).split() \
        or list(SYSTEM_KNOWN_HOSTS)
    known = tuple(os.path.expanduser(f) for f in (*user_files, *global_files)
                  if f not in ("/dev/null", "none"))
    return SshTarget(
        host=host, hostname=str(config.get("hostname", host)), port=port,
        user=options.user or str(config.get("user") or default_user), keys=keys,
        identities_only=only, known_hosts=known, host_keys=_host_key_mode(options, config),
        timeout=options.timeout,
    )


def remote_command(python: str, cwd: str) -> str:
    """The line sshd runs (through the login shell): cd, then the agent."""
    q = shlex.quote
    return f"cd {q(cwd)} || exit {CWD_MISSING}; exec {q(python)} -m {AGENT_MODULE}"


def config_lookup(path: str | None) -> Lookup:
    """ssh_config lookups from ``path`` (None: ~/.ssh/config when present)."""
    if path is None:
        default = os.path.expanduser(DEFAULT_CONFIG)
        if not os.path.isfile(default):
            return paramiko.SSHConfig().lookup
        path = default
    elif not os.path.isfile(path):
        raise DsrunUsageError(f"--ssh_config {path} does not exist")
    try:
        return paramiko.SSHConfig.from_path(path).lookup
    except (OSError, paramiko.ssh_exception.ConfigParseError) as exc:
        raise DsrunUsageError(f"ssh config {path}: {exc}") from None


# --------------------------------------------------------------------------
# connecting (I/O)


class SshConnectError(LaunchError):
    """A host could not be reached or refused us; the message names it."""


class _UnknownHostKey(paramiko.SSHException):
    def __init__(self, key: paramiko.PKey) -> None:
        super().__init__("unknown host key")
        self.key = key


class _HostKeyPolicy(paramiko.MissingHostKeyPolicy):
    """Called when the HostName has no entry: try the hostfile's name too."""

    def __init__(self, target: SshTarget, known: paramiko.HostKeys) -> None:
        self.target = target
        self.known = known

    def missing_host_key(self, client: paramiko.SSHClient, hostname: str,
                         key: paramiko.PKey) -> None:
        if self.target.host_keys == "off":
            return
        name = self.target.host
        names = [name] if self.target.port == SSH_PORT else [f"[{name}]:{self.target.port}"]
        for alias in names:
            entry = self.known.lookup(alias)
            if entry is not None and key.get_name() in entry:
                if entry[key.get_name()] == key:
                    return
                raise paramiko.BadHostKeyException(alias, key, entry[key.get_name()])
        if self.target.host_keys == "accept-new":
            return
        raise _UnknownHostKey(key)


def _load_known(client: paramiko.SSHClient, target: SshTarget) -> paramiko.HostKeys:
    known = paramiko.HostKeys()
    if target.host_keys == "off":
        return known
    for path in target.known_hosts:
        if os.path.isfile(path):
            try:
                client.load_system_host_keys(path)  # read only: never saved
                known.load(path)
            except (OSError, paramiko.SSHException) as exc:
                raise SshConnectError(f"cannot read known_hosts file {path}: {exc}") from None
    return known


def _unknown_key_message(target: SshTarget, key: paramiko.PKey) -> str:
    user_file = next((f for f in target.known_hosts if not f.startswith("/etc/")),
                     os.path.expanduser(USER_KNOWN_HOSTS[0]))
    port = f"-p {target.port} " if target.port != SSH_PORT else ""
    return (f"{target.host}: host key of {target.address} is not in known_hosts "
            f"({', '.join(target.known_hosts) or 'none'}); if its fingerprint "
            f"{key.fingerprint} is right, add it with `ssh-keyscan -H {port}{target.hostname}"
            f" >> {user_file}`, or pass --ssh_insecure to skip host key checks")


def _bad_key_message(target: SshTarget, name: str) -> str:
    """The fix names the known_hosts file that holds the old key (it may
    come from ssh_config's UserKnownHostsFile, which ssh-keygen -R without
    -f would not touch)."""
    where = next((path for path in target.known_hosts if _holds_key(path, name)), None)
    fix = f"ssh-keygen -R {shlex.quote(name)}"
    if where is not None:
        fix += f" -f {shlex.quote(where)}"
    return (f"{target.host}: host key of {target.address} does NOT match known_hosts"
            f"{f' ({where})' if where else ''} (someone may be intercepting the connection; "
            f"if the host was reinstalled, remove the old key with `{fix}`)")


def _holds_key(path: str, name: str) -> bool:
    known = paramiko.HostKeys()
    try:
        known.load(path)
    except (OSError, paramiko.SSHException):
        return False
    return known.lookup(name) is not None


def _open_socket(target: SshTarget) -> socket.socket:
    t = target.timeout
    try:
        return socket.create_connection((target.hostname, target.port), timeout=t)
    except socket.timeout:
        raise SshConnectError(f"{target.host}: no answer from {target.address} within "
                              f"{t:g}s (--ssh_timeout)") from None
    except ConnectionRefusedError:
        raise SshConnectError(f"{target.host}: connection refused by {target.address} "
                              f"(is sshd running there?)") from None
    except socket.gaierror as exc:
        raise SshConnectError(f"{target.host}: cannot resolve host name "
                              f"{target.hostname!r}: {exc.strerror}") from None
    except OSError as exc:
        raise SshConnectError(f"{target.host}: cannot connect to {target.address}: "
                              f"{exc.strerror or exc}") from None


def connect(target: SshTarget) -> paramiko.SSHClient:
    """An authenticated connection to ``target``; SshConnectError says why not."""
    for key in target.keys:
        if target.identities_only and not os.path.isfile(key):
            raise SshConnectError(f"{target.host}: ssh key {key} does not exist")
    sock = _open_socket(target)
    client = paramiko.SSHClient()
    try:
        client.set_missing_host_key_policy(_HostKeyPolicy(target, _load_known(client, target)))
        t = target.timeout
        client.connect(
            target.hostname, port=target.port, username=target.user, sock=sock,
            key_filename=[k for k in target.keys if os.path.isfile(k)] or None,
            look_for_keys=not target.identities_only, allow_agent=not target.identities_only,
            timeout=t, banner_timeout=t, auth_timeout=t, channel_timeout=t,
        )
        return client
    except BaseException as exc:
        client.close()
        sock.close()
        if isinstance(exc, Exception):
            raise SshConnectError(_connect_error(target, exc)) from None
        raise


def _connect_error(target: SshTarget, exc: Exception) -> str:
    if isinstance(exc, SshConnectError):
        return str(exc)
    if isinstance(exc, _UnknownHostKey):
        return _unknown_key_message(target, exc.key)
    if isinstance(exc, paramiko.BadHostKeyException):
        return _bad_key_message(target, exc.hostname)
    if isinstance(exc, paramiko.PasswordRequiredException):
        return f"{target.host}: the ssh key is encrypted; load it into ssh-agent first"
    if isinstance(exc, paramiko.AuthenticationException):
        keys = ", ".join(target.keys) or "default keys and ssh-agent"
        return (f"{target.host}: authentication as {target.user}@{target.address} failed "
                f"(tried {keys}); use --ssh_user/--ssh_key or User/IdentityFile in ssh config")
    # paramiko gives up on a silent server as "Error reading SSH protocol banner"
    # or, when the key exchange times out, as "No existing session" at auth.
    text = str(exc)
    if isinstance(exc, (socket.timeout, TimeoutError)) or "banner" in text \
            or "No existing session" in text:
        return (f"{target.host}: no SSH answer from {target.address} within "
                f"{target.timeout:g}s (--ssh_timeout)")
    return f"{target.host}: SSH to {target.address} failed: {exc or type(exc).__name__}"


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
        self.chan = transport.open_session(timeout=target.timeout)
        self.chan.exec_command(command)
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
            message += f" (is dsrun installed for {self.python} on {self.host}?)"
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
            user = self._user or getpass.getuser()
            self._targets[host] = resolve_target(host, self.options, self._lookup(host), user)
        return self._targets[host]

    def local_hosts(self, hosts: Sequence[str], hostname: str,
                    addresses: Sequence[str]) -> list[bool]:
        """This machine, also by its ssh_config HostName."""
        return [is_local_host(h, hostname, addresses) or
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
            start = f"{self.target(node.host).describe()}: {remote_command(self.python, plan.cwd)}"
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
        hosts = [n.host for n in plan.nodes]
        local = [n.local for n in plan.nodes]
        cwd = plan.cwd
        opened: list[AgentChannel] = []
        lock = threading.Lock()
        abandoned = False

        def one(host: str, is_local: bool) -> AgentChannel:
            channel = self._open_one(host, cwd, is_local)
            with lock:
                opened.append(channel)
                if abandoned:
                    _discard(channel)
            if not isinstance(channel, FailedChannel):
                on_connect(host)
            return channel

        pool = ThreadPoolExecutor(max_workers=max(1, len(hosts)),
                                  thread_name_prefix="dsrun-ssh")
        futures: list[Future[AgentChannel]] = [
            pool.submit(one, h, is_local) for h, is_local in zip(hosts, local)]
        try:
            channels = [f.result() for f in futures]
        except BaseException:
            with lock:
                abandoned = True
                for channel in opened:
                    _discard(channel)
            pool.shutdown(wait=False, cancel_futures=True)
            raise
        pool.shutdown(wait=False)
        return JobHandle(channels)

    def _open_one(self, host: str, cwd: str, is_local: bool) -> AgentChannel:
        if is_local:
            return LocalChannel(host, self.agent_argv(), cwd)
        try:
            target = self.target(host)
            start = time.monotonic()
            client = connect(target)
        except (SshConnectError, DsrunUsageError) as exc:
            return FailedChannel(host, str(exc))
        try:
            return SshChannel(target, client, remote_command(self.python, cwd), cwd,
                              self.python, time.monotonic() - start)
        except (paramiko.SSHException, OSError, EOFError) as exc:
            client.close()
            return FailedChannel(host, f"{host}: cannot start a command over SSH: {exc}")


def _discard(channel: AgentChannel) -> None:
    channel.end_input()
    channel.kill()
    channel.close()
