"""How the SSH connection reaches a host: directly, through ssh_config's
ProxyCommand, or through ProxyJump hosts, as OpenSSH does.

ProxyCommand runs through the user's shell (``$SHELL -c "exec CMD"``, as
ssh does) with ``%h %p %r %n %%`` filled in from the resolved target (so
--ssh_port/--ssh_user count); its stderr is kept for the error message.
ProxyJump: ``[user@]host[:port]`` (also ``ssh://...``), a comma list for a
chain; the host before the target is reached with the hops before it as
its own ProxyJump, and each jump host's own ssh_config entry applies (the
--ssh_port/--ssh_user/--ssh_key flags are for the job's hosts, not the
jump hosts, as with ``ssh -J``). The target is then reached over a
``direct-tcpip`` channel of the jump host's connection; that connection is
opened once per jump chain and shared by all hosts behind it (:class:`JumpPool`),
and it closes with the last of their connections (:class:`RoutedClient`).
"""

from __future__ import annotations

import collections
import os
import re
import select
import socket
import subprocess
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import paramiko

from dsrun.errors import DsrunUsageError, LaunchError

if TYPE_CHECKING:
    from dsrun.launcher.backends.ssh_connect import SshTarget

_TOKEN = re.compile(r"%(.?)")
#: A login name that is safe in a shell command (ProxyCommand's %r): POSIX
#: names, DOMAIN\\user, user@domain, a trailing $ (machine accounts).
_SAFE_USER = re.compile(r"[A-Za-z0-9_.][A-Za-z0-9_.@\\-]*\$?")
#: How long a ProxyCommand may take to exit after its connection closes.
PROXY_EXIT_S = 2.0


class SshConnectError(LaunchError):
    """A host could not be reached or refused us; the message names it."""


class Closeable(Protocol):
    def close(self) -> None: ...


@dataclass(frozen=True)
class Hop:
    """One ProxyJump host as written: ``[user@]host[:port]``."""

    host: str
    user: str | None = None
    port: int | None = None

    def text(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        user = f"{self.user}@" if self.user else ""
        return f"{user}{host}{f':{self.port}' if self.port else ''}"


def check_user(user: str, where: str) -> None:
    """Refuse a login name with shell metacharacters (as OpenSSH 9.6 does
    for the command line's): it goes unquoted into ProxyCommand's shell."""
    if not _SAFE_USER.fullmatch(user):
        raise DsrunUsageError(f"{where}: bad user name {user!r} (letters, digits, and . _ - @ "
                              f"\\, a $ at the end; not starting with - or @)")


def parse_jumps(value: str, host: str) -> list[Hop]:
    """The hops of a ProxyJump value; DsrunUsageError names a bad one."""
    hops = []
    for part in (p.strip() for p in value.split(",")):
        rest = part[len("ssh://"):].rstrip("/") if part.startswith("ssh://") else part
        user, _, rest = rest.rpartition("@")
        port_text = ""
        if rest.startswith("["):
            name, _, tail = rest[1:].partition("]")
            port_text = tail[1:] if tail.startswith(":") else tail
        elif rest.count(":") == 1:
            name, port_text = rest.split(":")
        else:
            name = rest
        port = None
        if port_text:
            port = int(port_text) if port_text.isdigit() else 0
            if not 1 <= port <= 65535:
                name = ""
        if not name or any(c.isspace() for c in name):
            raise DsrunUsageError(f"ssh config: bad ProxyJump {value!r} for host {host}: "
                                  f"{part!r} is not [user@]host[:port]")
        if user:
            check_user(user, f"ssh config: ProxyJump {value!r} for host {host}")
        hops.append(Hop(name, user or None, port))
    return hops


def expand_tokens(text: str, target: SshTarget, key: str) -> str:
    """``%h %p %r %n %%`` of ProxyCommand/ProxyJump, from the resolved target."""
    table = {"h": target.hostname, "p": str(target.port), "r": target.user,
             "n": target.host, "%": "%"}

    def one(match: re.Match[str]) -> str:
        if match.group(1) not in table:
            raise DsrunUsageError(f"ssh config: {key} for host {target.host} has "
                                  f"%{match.group(1)}, which dsrun does not know "
                                  f"(it fills in %h %p %r %n %%): {text!r}")
        return table[match.group(1)]

    return _TOKEN.sub(one, text)


class ShellProxyCommand(paramiko.ProxyCommand):
    """paramiko.ProxyCommand run through the shell as ssh runs it, that
    reports the command's end as end of file (paramiko's spins until its
    timeout) and keeps the command's last stderr lines."""

    def __init__(self, command: str) -> None:  # no super(): it would start the process
        self.command = command
        self.cmd = [os.environ.get("SHELL") or "/bin/sh", "-c", f"exec {command}"]
        self.timeout: float | None = None
        self.process = subprocess.Popen(self.cmd, stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                        bufsize=0)
        self._err: collections.deque[str] = collections.deque(maxlen=10)
        self._reader = threading.Thread(target=self._drain, daemon=True,
                                        name="dsrun-proxycommand-stderr")
        self._reader.start()

    def _drain(self) -> None:
        assert self.process.stderr is not None
        for line in iter(self.process.stderr.readline, b""):
            if line.strip():
                self._err.append(line.decode("utf-8", "replace").strip())

    def recv(self, size: int) -> bytes:
        assert self.process.stdout is not None
        ready, _, _ = select.select([self.process.stdout], [], [], self.timeout)
        if not ready:
            raise socket.timeout()
        try:
            data = os.read(self.process.stdout.fileno(), size)
        except OSError as exc:
            raise paramiko.ProxyCommandFailure(self.command, exc.strerror) from None
        if not data:  # paramiko's EOFError; the command is exiting: keep its status
            try:
                self.process.wait(PROXY_EXIT_S)
            except subprocess.TimeoutExpired:
                pass
        return data

    def stderr_tail(self) -> str:
        self._reader.join(0.5)  # what it wrote just before it exited
        return self._err[-1] if self._err else ""

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(PROXY_EXIT_S)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        for stream in (self.process.stdin, self.process.stdout):
            if stream is not None:
                try:
                    stream.close()
                except OSError:
                    pass
        self._reader.join(PROXY_EXIT_S)
        if self.process.stderr is not None and not self._reader.is_alive():
            self.process.stderr.close()  # else the reader still reads it (a child kept it)


class RoutedClient(paramiko.SSHClient):
    """An SSHClient that also closes what carries its connection (the jump
    host's connection, the ProxyCommand) when it is closed."""

    def __init__(self, carriers: list[Any]) -> None:
        super().__init__()
        self.carriers = carriers

    def close(self) -> None:
        try:
            super().close()
        finally:
            carriers, self.carriers = self.carriers, []
            for carrier in reversed(carriers):
                carrier.close()


Connect = Callable[["SshTarget"], paramiko.SSHClient]


class _SharedJump:
    """One connection to a jump host (a jump chain: the target includes its
    own jumps), opened once for all the hosts reached through it."""

    def __init__(self, jump: SshTarget) -> None:
        self.jump = jump
        self.users = 0  # counted under the pool's lock
        self.opening = threading.Lock()  # the first user opens, the others wait
        self.client: paramiko.SSHClient | None = None
        self.error: str | None = None

    def alive(self) -> bool:
        if self.client is None:
            return self.error is None  # still being opened
        transport = self.client.get_transport()
        return transport is not None and transport.is_active()

    def open(self, connect: Connect) -> paramiko.SSHClient:
        with self.opening:
            if self.client is None and self.error is None:
                try:
                    self.client = connect(self.jump)
                except SshConnectError as exc:
                    self.error = str(exc)  # for every host waiting on it: one try
            if self.client is None:
                raise SshConnectError(self.error or f"no connection to {self.jump.host}")
            return self.client


class JumpPool:
    """The jump host connections of this process: one per distinct jump
    chain, shared by the connections routed through it (paramiko multiplexes
    their direct-tcpip channels), closed with the last of them. N hosts
    behind one bastion made N connections to it at once, which sshd's
    MaxStartups (10:30:100) starts dropping at 10."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._shared: dict[SshTarget, _SharedJump] = {}

    def use(self, jump: SshTarget, connect: Connect) -> tuple[paramiko.SSHClient, JumpUse]:
        """The connection to ``jump`` and this user's handle on it (close
        the handle, not the client); SshConnectError when it cannot be opened."""
        with self._lock:
            shared = self._shared.get(jump)
            if shared is None or not shared.alive():  # new, or its connection died
                shared = self._shared[jump] = _SharedJump(jump)
            shared.users += 1
        handle = JumpUse(self, shared)
        try:
            return shared.open(connect), handle
        except BaseException:
            handle.close()
            raise

    def release(self, shared: _SharedJump) -> None:
        with self._lock:
            shared.users -= 1
            if shared.users > 0:
                return
            if self._shared.get(shared.jump) is shared:
                del self._shared[shared.jump]
        if shared.client is not None:
            shared.client.close()


class JumpUse:
    """One routed connection's hold on a shared jump connection; closing
    it (once) closes the jump connection when it is the last."""

    def __init__(self, pool: JumpPool, shared: _SharedJump) -> None:
        self._pool: JumpPool | None = pool
        self._shared = shared

    def close(self) -> None:
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.release(self._shared)


#: The pool open_route uses unless given another.
JUMPS = JumpPool()


def open_route(target: SshTarget, connect: Connect,
               direct: Callable[[SshTarget], socket.socket],
               jumps: JumpPool = JUMPS) -> tuple[Any, list[Any]]:
    """The socket-like object the SSH session to ``target`` runs over, and
    what must be closed with that session."""
    if target.proxy_command:
        command = expand_tokens(target.proxy_command, target, "ProxyCommand")
        try:
            proxy = ShellProxyCommand(command)
        except OSError as exc:
            raise SshConnectError(f"{target.host}: cannot run ProxyCommand {command!r}: "
                                  f"{exc.strerror or exc}") from None
        return proxy, [proxy]
    if target.jump is None:
        return direct(target), []
    jump = target.jump
    try:
        client, handle = jumps.use(jump, connect)
    except SshConnectError as exc:
        raise SshConnectError(f"{target.host}: through ProxyJump host {jump.host}: "
                              f"{exc}") from None
    try:
        transport = client.get_transport()
        assert transport is not None
        channel = transport.open_channel("direct-tcpip", (target.hostname, target.port),
                                         ("127.0.0.1", 0), timeout=target.timeout)
    except BaseException as exc:
        handle.close()
        if isinstance(exc, paramiko.ChannelException):
            raise SshConnectError(f"{target.host}: ProxyJump host {jump.host} cannot reach "
                                  f"{target.address}: {exc.text}") from None
        if isinstance(exc, (paramiko.SSHException, OSError, EOFError)):
            raise SshConnectError(f"{target.host}: ProxyJump host {jump.host} did not open "
                                  f"a connection to {target.address} within "
                                  f"{target.timeout:g}s: {exc}") from None
        raise
    return channel, [handle]


def proxy_failure(target: SshTarget, carriers: list[Any]) -> str | None:
    """Why the ProxyCommand failed, when it did (it exited, or said so)."""
    proxy = next((c for c in carriers if isinstance(c, ShellProxyCommand)), None)
    if proxy is None:
        return None
    code = proxy.process.poll()
    said = proxy.stderr_tail()
    if code is None and not said:
        return None
    status = f"exited with status {code}" if code is not None else "failed"
    return (f"{target.host}: ProxyCommand {proxy.command!r} {status}"
            f"{f': {said}' if said else ''}")
