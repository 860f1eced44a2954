"""Host key checks of an SSH connection, as OpenSSH makes them: the names
a host's key is looked up under (HostKeyAlias, else the HostName
connected to, ``[name]:port`` for a port other than 22 with a port-less
fallback; never the hostfile's name), paramiko's host key policy that
judges every server key against the known_hosts files (ssh_known.py; keys
are never saved), and the error message for each way a key is refused,
with the fix. :mod:`.ssh_connect` opens the connections that use them.
"""

from __future__ import annotations

import os
import shlex
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import paramiko

from dsrun.launcher.backends.ssh_known import KnownHosts, KnownKey, check_key, load_file, warn
from dsrun.launcher.backends.ssh_proxy import SshConnectError

if TYPE_CHECKING:
    from dsrun.launcher.backends.ssh_connect import SshTarget

SSH_PORT = 22
USER_KNOWN_HOSTS = ("~/.ssh/known_hosts", "~/.ssh/known_hosts2")


def key_names(target: SshTarget) -> tuple[list[str], list[str]]:
    """The names a host's key is looked up under, and the port-less ones
    tried when those have no entry: as OpenSSH, the HostKeyAlias, else the
    HostName it connects to (``[name]:port`` for a port other than 22),
    never the hostfile's name for it (an entry under that name is only
    pointed out in the error: :func:`_hostfile_name_entry`)."""
    if target.host_key_alias:
        return [target.host_key_alias], []
    if target.port == SSH_PORT:
        return [target.hostname], []
    return [f"[{target.hostname}]:{target.port}"], [target.hostname]


def _hostfile_name_entry(known: KnownHosts, target: SshTarget) -> KnownKey | None:
    """A known_hosts entry under the hostfile's name of ``target`` where that
    is not the name looked up (its HostName): ssh does not use it, and the
    unknown-key error says so, with the fix."""
    if target.host_key_alias or target.host == target.hostname:
        return None
    names = [target.host] if target.port == SSH_PORT else \
        [f"[{target.host}]:{target.port}", target.host]
    found = known.find(names)
    return found[0] if found else None


class UnknownHostKey(paramiko.SSHException):
    def __init__(self, key: paramiko.PKey, authority: KnownKey | None = None,
                 other_name: KnownKey | None = None) -> None:
        super().__init__("unknown host key")
        self.key = key
        self.authority = authority
        self.other_name = other_name  # an entry under the hostfile's name, unused


class RejectedHostKey(paramiko.SSHException):
    """A changed (``kind == "changed"``) or @revoked host key."""

    def __init__(self, kind: str, key: paramiko.PKey, entry: KnownKey, name: str,
                 portless: bool = False) -> None:
        super().__init__(f"{kind} host key")
        self.kind, self.key, self.entry, self.name = kind, key, entry, name
        self.portless = portless


class HostKeyPolicy(paramiko.MissingHostKeyPolicy):
    """The whole host key check: paramiko's client holds no keys, so it
    asks here for every server key."""

    def __init__(self, target: SshTarget, known: KnownHosts) -> None:
        self.target = target
        self.known = known

    def missing_host_key(self, client: paramiko.SSHClient, hostname: str,
                         key: paramiko.PKey) -> None:
        target = self.target
        if target.host_keys == "off":
            return
        names, fallback = key_names(target)
        verdict = check_key(self.known, names, fallback, key.get_name(), key.asbytes())
        if verdict.kind == "ok":
            return
        if verdict.kind == "revoked" or (verdict.kind == "changed" and
                                         target.host_keys != "no"):
            assert verdict.entry is not None
            raise RejectedHostKey(verdict.kind, key, verdict.entry, verdict.name,
                                   verdict.portless)
        if verdict.kind == "changed":  # StrictHostKeyChecking no: warn, as ssh does
            assert verdict.entry is not None
            warn(f"{target.host}: host key of {target.address} does NOT match "
                        f"known_hosts ({verdict.entry.where}); connecting anyway "
                        f"(StrictHostKeyChecking no)")
            return
        if target.host_keys in ("accept-new", "no"):
            return
        raise UnknownHostKey(key, verdict.entry, _hostfile_name_entry(self.known, target))


def load_known(target: SshTarget) -> KnownHosts:
    if target.host_keys == "off":
        return KnownHosts()
    try:
        return KnownHosts.load(target.known_hosts)
    except OSError as exc:
        raise SshConnectError(f"cannot read known_hosts file {exc.filename}: "
                              f"{exc.strerror or exc}") from None


def transport_factory(key_types: list[str]) -> Callable[..., paramiko.Transport]:
    """Transports that ask the server for the host key types known for it
    first (as ssh does), so a host with several keys shows the known one."""

    def base(algorithm: str) -> str:
        return "ssh-rsa" if algorithm.startswith("rsa-sha2-") else algorithm

    def make(sock: Any, **kwargs: Any) -> paramiko.Transport:
        transport = paramiko.Transport(sock, **kwargs)
        options = transport.get_security_options()
        first = sorted((a for a in options.key_types if base(a) in key_types),
                       key=lambda a: key_types.index(base(a)))
        options.key_types = first + [a for a in options.key_types if a not in first]
        return transport

    return make


def _user_file(target: SshTarget) -> str:
    return next((f for f in target.known_hosts if not f.startswith("/etc/")),
                os.path.expanduser(USER_KNOWN_HOSTS[0]))


def _looked_up(target: SshTarget) -> str:
    """The names :func:`key_names` looks a host key up under, for errors."""
    names, fallback = key_names(target)
    return " or ".join(names + fallback)


def unknown_key_message(target: SshTarget, key: paramiko.PKey,
                         authority: KnownKey | None = None,
                         other_name: KnownKey | None = None) -> str:
    user_file = _user_file(target)
    where = f"({', '.join(target.known_hosts) or 'none'})"
    if target.host_key_alias:
        return (f"{target.host}: host key of {target.address} is not in known_hosts {where} "
                f"under its HostKeyAlias {target.host_key_alias}; if its fingerprint "
                f"{key.fingerprint} is right, add the line `{target.host_key_alias} "
                f"{key.get_name()} {key.get_base64()}` to {user_file}, or pass "
                f"--ssh_insecure to skip host key checks")
    port = f"-p {target.port} " if target.port != SSH_PORT else ""
    fix = f"`ssh-keyscan -H {port}{target.hostname} >> {user_file}`"
    if authority is not None:
        return (f"{target.host}: {authority.where} trusts a host certificate authority "
                f"(@cert-authority) for {target.hostname}, and dsrun cannot check host "
                f"certificates; if the host key's fingerprint {key.fingerprint} is right, "
                f"add the key itself with {fix}, or pass --ssh_insecure to skip host key "
                f"checks")
    unused = "" if other_name is None else (
        f" (the entry {other_name.where} for the hostfile's name {target.host} is not used: "
        f"as ssh does, dsrun looks the key up under the HostName it connects to, or under "
        f"HostKeyAlias; set `HostKeyAlias {target.host}` for it in ssh config to use that "
        f"entry)")
    return (f"{target.host}: host key of {target.address} is not in known_hosts "
            f"{where} under the name {_looked_up(target)}{unused}; if its fingerprint "
            f"{key.fingerprint} is right, add it with {fix}, or pass --ssh_insecure to skip "
            f"host key checks")


def bad_key_message(target: SshTarget, name: str, where: str | None = None) -> str:
    """The fix names the known_hosts file that holds the old key (it may
    come from ssh_config's UserKnownHostsFile, which ssh-keygen -R without
    -f would not touch)."""
    if where is None:
        where = next((path for path in target.known_hosts if _holds_key(path, name)), None)
    fix = f"ssh-keygen -R {shlex.quote(name)}"
    if where is not None:
        fix += f" -f {shlex.quote(where)}"
    return (f"{target.host}: host key of {target.address} does NOT match known_hosts"
            f"{f' ({where})' if where else ''} (someone may be intercepting the connection; "
            f"if the host was reinstalled, remove the old key with `{fix}`)")


def rejected_message(target: SshTarget, exc: RejectedHostKey) -> str:
    if exc.kind == "changed" and exc.portless:
        # OpenSSH takes this for an unknown key ([host]:port has no entry):
        # an sshd on another port (a container) may well have keys of its own.
        return (f"{target.host}: host key of {target.address} is not in known_hosts for "
                f"port {target.port} and does NOT match the port-less entry "
                f"{exc.entry.where}; if the sshd on port {target.port} has keys of its own "
                f"and its fingerprint {exc.key.fingerprint} is right, add it with "
                f"`ssh-keyscan -H -p {target.port} {target.hostname} >> "
                f"{_user_file(target)}`, or pass --ssh_insecure to skip host key checks")
    if exc.kind == "changed":
        return bad_key_message(target, exc.name, exc.entry.path)
    return (f"{target.host}: host key of {target.address} ({exc.key.fingerprint}) is "
            f"marked @revoked in {exc.entry.where}; refusing to connect (ask the host's "
            f"administrator for its new key)")


def _holds_key(path: str, name: str) -> bool:
    try:
        return any(k.matches(name) for k in load_file(path) if not k.marker)
    except OSError:
        return False
