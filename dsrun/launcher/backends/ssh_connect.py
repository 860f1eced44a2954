"""Opening one SSH connection: where to (ssh_config and the --ssh_* flags,
resolved into a frozen :class:`SshTarget`), host key checks against the
known_hosts files (never saved), and one error message per way it fails,
naming the host and the fix.
"""

from __future__ import annotations

import os
import shlex
import socket
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import paramiko

from dsrun.errors import DsrunUsageError, LaunchError
from dsrun.launcher.spec import SshOptions

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
