"""Which keys to log in with, chosen as OpenSSH chooses them.

For every configured identity (``--ssh_key``, else ssh_config's
IdentityFile) ssh-agent's copy is used when the agent holds it (its public
half: ``KEY.pub``, or the clear public part of an OpenSSH-format key file),
so a passphrase-protected key unlocked once with ``ssh-add`` works, also
with ``IdentitiesOnly yes`` (which means "only these identities", not "no
agent"). Otherwise the file itself is loaded; an encrypted one that the
agent does not hold is skipped with the reason. Without IdentitiesOnly the
agent's other keys and the default ``~/.ssh/id_*`` files follow.

:func:`key_plan` never connects; with nothing to try it says so, listing
what it looked at, instead of paramiko's "No authentication methods
available".
"""

from __future__ import annotations

import base64
import binascii
import os
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


@dataclass
class KeyPlan:
    """The keys to offer, in order, and a note per place looked at."""

    sources: list[AuthSource] = field(default_factory=list)
    tried: list[str] = field(default_factory=list)
    agent: paramiko.Agent | None = None

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


def key_plan(target: SshTarget,
             agent_factory: Callable[[], paramiko.Agent] | None = None) -> KeyPlan:
    """The keys to offer to ``target``, agent copies first where they exist."""
    plan = KeyPlan()
    agent_keys: list[paramiko.AgentKey] = []
    if os.environ.get("SSH_AUTH_SOCK") or agent_factory is not None:
        plan.agent = (agent_factory or paramiko.Agent)()
        agent_keys = list(plan.agent.get_keys())
        agent_note = f"ssh-agent ({len(agent_keys)} keys)"
    else:
        agent_note = "ssh-agent (SSH_AUTH_SOCK is not set)"
    used: set[bytes] = set()
    user = target.user
    for path in target.keys:
        blob = public_blob(path)
        held = next((k for k in agent_keys if blob is not None and k.asbytes() == blob), None)
        if held is not None:
            used.add(held.asbytes())
            plan.sources.append(InMemoryPrivateKey(user, held))
            plan.tried.append(f"{path} (from ssh-agent)")
        else:
            _add_file(plan, user, path)
    if not target.identities_only:
        rest = [k for k in agent_keys if k.asbytes() not in used]
        plan.sources.extend(InMemoryPrivateKey(user, k) for k in rest)
        plan.tried.append(agent_note)
        for path in (os.path.expanduser(p) for p in DEFAULT_KEYS):
            if path not in target.keys and os.path.isfile(path):
                _add_file(plan, user, path)
        if not any(os.path.isfile(os.path.expanduser(p)) for p in DEFAULT_KEYS):
            plan.tried.append(f"{', '.join(DEFAULT_KEYS)} (none exist)")
    return plan


def _add_file(plan: KeyPlan, user: str, path: str) -> None:
    if not os.path.exists(path):
        plan.tried.append(f"{path} (does not exist)")
        return
    try:
        key = load_key(path)
    except paramiko.PasswordRequiredException:
        where = "ssh-agent does not hold it" if plan.agent is not None else \
            "no ssh-agent (SSH_AUTH_SOCK is not set)"
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
