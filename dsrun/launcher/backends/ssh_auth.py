"""Which keys to log in with, chosen as OpenSSH chooses them.

For every configured identity (``--ssh_key``, else ssh_config's
IdentityFile) ssh-agent's copy is used when the agent holds it (its public
half: ``KEY.pub``, or the clear public part of an OpenSSH-format key file),
so a passphrase-protected key unlocked once with ``ssh-add`` works, also
with ``IdentitiesOnly yes`` (which means "only these identities", not "no
agent"). Otherwise the file itself is loaded; an encrypted one that the
agent does not hold is skipped with the reason. Without IdentityFile (and
--ssh_key) the configured identities are the default ``~/.ssh/id_*``
files, also with IdentitiesOnly; with one, the default files are not
offered at all (OpenSSH adds them only when no identity file is
configured: readconf.c fill_default_options). Without IdentitiesOnly the
agent's other keys follow. An ssh-agent that does not answer is skipped
with a warning (and named in the error), as ssh skips it.

:func:`key_plan` never connects; with nothing to try it says so, listing
what it looked at, instead of paramiko's "No authentication methods
available".
"""

from __future__ import annotations

import base64
import binascii
import logging
import os
import socket
import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import paramiko
from paramiko.auth_strategy import AuthSource, AuthStrategy, InMemoryPrivateKey

if TYPE_CHECKING:
    from dsrun.launcher.backends.ssh_connect import SshTarget

DEFAULT_KEYS = ("~/.ssh/id_rsa", "~/.ssh/id_ecdsa", "~/.ssh/id_ed25519")
_OPENSSH_BEGIN = "-----BEGIN OPENSSH PRIVATE KEY-----"
_OPENSSH_MAGIC = b"openssh-key-v1\x00"
log = logging.getLogger(__name__)


@dataclass
class KeyPlan:
    """The keys to offer, in order, and a note per place looked at."""

    sources: list[AuthSource] = field(default_factory=list)
    tried: list[str] = field(default_factory=list)
    agent: paramiko.Agent | None = None
    agent_note: str = ""  # what became of ssh-agent, for the error messages
    agent_failed: bool = False  # SSH_AUTH_SOCK is set, but the agent did not answer

    def strategy(self) -> AuthStrategy:
        return _Keys(self.sources)

    def close(self) -> None:
        if self.agent is not None:
            self.agent.close()


class _Keys(AuthStrategy):
    def __init__(self, sources: list[AuthSource]) -> None:
        super().__init__(ssh_config=paramiko.SSHConfig())
        self.sources = sources

    def get_sources(self) -> Iterator[AuthSource]:
        yield from self.sources


def public_blob(path: str) -> bytes | None:
    """The public key of a private key file, without decrypting it."""
    try:
        with open(f"{path}.pub", encoding="ascii", errors="replace") as f:
            fields = f.read().split()
        if len(fields) >= 2:
            return base64.b64decode(fields[1], validate=True)
    except (OSError, binascii.Error, ValueError):
        pass
    try:
        with open(path, encoding="ascii", errors="replace") as f:
            text = f.read()
    except OSError:
        return None
    if _OPENSSH_BEGIN not in text:
        return None  # a PEM key has no clear public part
    body = "".join(ln for ln in text.splitlines() if ln and not ln.startswith("-----"))
    try:
        data = base64.b64decode(body)
        if not data.startswith(_OPENSSH_MAGIC):
            return None
        pos = len(_OPENSSH_MAGIC)
        for _ in range(3):  # cipher, kdf name, kdf options
            (size,) = struct.unpack(">I", data[pos:pos + 4])
            pos += 4 + size
        pos += 4  # number of keys; the first public key follows
        (size,) = struct.unpack(">I", data[pos:pos + 4])
        return data[pos + 4:pos + 4 + size] or None
    except (binascii.Error, ValueError, struct.error):
        return None


class _Agent(paramiko.Agent):
    """paramiko.Agent on a socket with a timeout (an agent that never
    answers would hang every connection), that says when it cannot connect
    (paramiko's takes a dead socket for an agent without keys)."""

    def __init__(self, path: str, timeout: float) -> None:  # no super(): it would connect
        paramiko.agent.AgentSSH.__init__(self)
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.settimeout(timeout)
        try:
            conn.connect(path)
            self._connect(conn)
        except BaseException:
            conn.close()
            raise


def _open_agent(target: SshTarget, plan: KeyPlan,
                agent_factory: Callable[[], paramiko.Agent] | None) -> list[paramiko.AgentKey]:
    """ssh-agent's keys; none, with a warning, when the agent does not
    answer (a forwarded agent whose far end is gone): as ssh does, the key
    files are tried without it."""
    path = os.environ.get("SSH_AUTH_SOCK")
    if not path and agent_factory is None:
        plan.agent_note = "no ssh-agent (SSH_AUTH_SOCK is not set)"
        return []
    try:
        wait = target.session_timeout or target.timeout
        plan.agent = agent_factory() if agent_factory else _Agent(str(path), wait)
        keys = list(plan.agent.get_keys())
    except (paramiko.SSHException, OSError, EOFError) as exc:
        plan.close()
        plan.agent, plan.agent_failed = None, True
        why = "no answer" if isinstance(exc, socket.timeout) else \
            getattr(exc, "strerror", None) or str(exc) or type(exc).__name__
        plan.agent_note = f"ssh-agent at SSH_AUTH_SOCK={path} did not answer ({why})"
        log.warning("%s: %s; trying the key files without it", target.host, plan.agent_note)
        return []
    plan.agent_note = f"ssh-agent ({len(keys)} keys)"
    return keys


def key_plan(target: SshTarget,
             agent_factory: Callable[[], paramiko.Agent] | None = None) -> KeyPlan:
    """The keys to offer to ``target``, agent copies first where they exist.
    The configured identities are ``target.keys``, else (as in ssh, also
    with IdentitiesOnly) the default ~/.ssh/id_* files; the default files
    are offered only when ``target.keys`` is empty, as in ssh."""
    plan = KeyPlan()
    agent_keys = _open_agent(target, plan, agent_factory)
    # as ssh: the defaults stand in for IdentityFile only when none is configured
    defaults = [] if target.keys else [os.path.expanduser(p) for p in DEFAULT_KEYS]
    configured = list(target.keys)
    if not configured and target.identities_only:
        configured = [p for p in defaults if os.path.isfile(p)]
    used: set[bytes] = set()
    user = target.user
    for path in configured:
        blob = public_blob(path)
        held = next((k for k in agent_keys if blob is not None and k.asbytes() == blob), None)
        if held is not None:
            used.add(held.asbytes())
            plan.sources.append(InMemoryPrivateKey(user, held))
            plan.tried.append(f"{path} (from ssh-agent)")
        else:
            _add_file(plan, user, path)
    if target.identities_only and plan.agent_failed:
        plan.tried.append(plan.agent_note)
    if not target.identities_only:
        rest = [k for k in agent_keys if k.asbytes() not in used]
        plan.sources.extend(InMemoryPrivateKey(user, k) for k in rest)
        plan.tried.append(plan.agent_note)
        for path in defaults:
            if path not in configured and os.path.isfile(path):
                _add_file(plan, user, path)
    if not target.keys and not any(os.path.isfile(p) for p in defaults):
        plan.tried.append(f"{', '.join(DEFAULT_KEYS)} (none exist)")
    return plan


def _add_file(plan: KeyPlan, user: str, path: str) -> None:
    if not os.path.exists(path):
        plan.tried.append(f"{path} (does not exist)")
        return
    try:
        key = load_key(path)
    except paramiko.PasswordRequiredException:
        if plan.agent is None:
            where = plan.agent_note
        elif public_blob(path) is None:  # a PEM key: nothing to match the agent's keys with
            where = f"no {path}.pub to match ssh-agent's keys against"
        else:
            where = "ssh-agent does not hold it"
        plan.tried.append(f"{path} (encrypted, and {where}: load it with `ssh-add {path}`)")
        return
    except (paramiko.SSHException, OSError, ValueError) as exc:
        plan.tried.append(f"{path} (cannot be read: {exc})")
        return
    plan.sources.append(InMemoryPrivateKey(user, key))
    plan.tried.append(path)


def load_key(path: str) -> paramiko.PKey:
    """The private key in ``path`` (its ``-cert.pub`` certificate loaded
    too), tried as each key type paramiko's SSHClient tries;
    PasswordRequiredException when it is encrypted. (PKey.from_path raises
    a bare TypeError for an encrypted OpenSSH-format key.)"""
    error: Exception | None = None
    for kind in (paramiko.RSAKey, paramiko.ECDSAKey, paramiko.Ed25519Key):
        try:
            key = kind.from_private_key_file(path)
        except paramiko.PasswordRequiredException:
            raise
        except (paramiko.SSHException, ValueError, TypeError) as exc:
            error = exc
            continue
        if os.path.isfile(f"{path}-cert.pub"):
            key.load_certificate(f"{path}-cert.pub")
        return key
    raise paramiko.SSHException(f"not a key paramiko can use ({error})")


def no_key_message(target: SshTarget, plan: KeyPlan) -> str:
    looked = "; ".join(plan.tried) or "nothing"
    return (f"{target.host}: no ssh key to log in as {target.user}@{target.address} "
            f"(looked at: {looked}); give one with --ssh_key or IdentityFile in ssh config, "
            f"or load it into ssh-agent")
