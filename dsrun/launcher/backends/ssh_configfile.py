"""Reading an ssh_config file as OpenSSH does before paramiko parses it.

paramiko.SSHConfig drops ``Include`` lines (it reads them as an unknown
key), so they are expanded here first: paths relative to ~/.ssh (the file
is a user configuration: ~/.ssh/config or --ssh_config, as with ``ssh
-F``), ``~`` and ``${VAR}``, glob patterns in sorted order, files that do
not exist ignored, at most 16 levels deep. An Include inside a Host or
Match block applies to that block only; the block's header is written
again after the included text so that the lines after it stay in it.

Several files are read as OpenSSH reads ~/.ssh/config and then
/etc/ssh/ssh_config (:func:`read_configs`): one after the other, the first
value obtained for a key winning, each file's relative Includes taken from
its own directory (~/.ssh, /etc/ssh), and the lines before a later file's
first Host/Match applying to every host, as at the top of a file.

ProxyCommand and ProxyJump keep their ``%`` tokens here (paramiko would
fill in the config's Port and User, not --ssh_port/--ssh_user): the
connection fills them in (ssh_proxy.py).

What dsrun cannot honour is collected as notes that connection errors
quote: ``Match`` criteria paramiko does not know (it treats them as
matching; noted for the hosts whose lookup applied that block), and, per
host, settings that change how to connect (:func:`unused_settings`).
"""

from __future__ import annotations

import glob
import os
import re
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import paramiko

from dsrun.errors import DsrunUsageError

#: OpenSSH's READCONF_MAX_DEPTH.
MAX_INCLUDE_DEPTH = 16
USER_CONFIG_DIR = "~/.ssh"
SYSTEM_CONFIG_DIR = "/etc/ssh"
_LINE = re.compile(r"(\w+)(?:\s*=\s*|\s+)(.*)")
_ENV = re.compile(r"\$\{(\w+)\}")
#: Match criteria paramiko evaluates; others it treats as matching.
PARAMIKO_MATCH = frozenset({"all", "canonical", "final", "host", "originalhost", "user",
                            "localuser", "exec"})
_NO_PARAM = frozenset({"all", "canonical", "final"})

#: ssh_config keys (lowercase, as paramiko returns them) that change how or
#: where OpenSSH connects and that dsrun does not use; their spelling.
UNUSED_KEYS = {k.lower(): k for k in (
    "AddressFamily", "BindAddress", "BindInterface", "CertificateFile", "IdentityAgent",
    "KnownHostsCommand", "PKCS11Provider", "SecurityKeyProvider", "HostKeyAlgorithms",
    "KexAlgorithms", "Ciphers", "MACs", "PubkeyAcceptedAlgorithms",
    "PubkeyAcceptedKeyTypes", "PreferredAuthentications", "RevokedHostKeys",
    "ForwardAgent", "ControlPath", "RemoteCommand")}
# values of those keys that are the same as what dsrun does anyway
_HARMLESS = {"identityagent": "ssh_auth_sock", "forwardagent": "no", "controlpath": "none"}


class _RawProxyConfig(paramiko.SSHConfig):
    """paramiko.SSHConfig, but ProxyCommand/ProxyJump keep their tokens."""

    TOKENS_BY_CONFIG_KEY = {**paramiko.SSHConfig.TOKENS_BY_CONFIG_KEY,
                            "proxycommand": [], "proxyjump": []}


@dataclass(frozen=True)
class ConfigFile:
    """A parsed ssh_config and what in it dsrun cannot evaluate."""

    config: paramiko.SSHConfig
    #: (index of the Match block in paramiko's parsed blocks, its note)
    match_notes: tuple[tuple[int, str], ...] = ()

    def lookup(self, host: str) -> dict[str, Any]:
        return dict(self.config.lookup(host))

    def notes_for(self, host: str, found: dict[str, Any]) -> tuple[str, ...]:
        """The notes of the Match blocks paramiko applied to ``host`` (its
        lookup result ``found``): not those of blocks it could not match."""
        return tuple(note for index, note in self.match_notes
                     if self._applies(self.config._config[index], host, found))

    def _applies(self, block: dict[str, Any], host: str, found: dict[str, Any]) -> bool:
        matches = block.get("matches", [])
        if any(m["type"] == "exec" for m in matches):
            return True  # not run again here
        return bool(self.config._does_match(matches, host, False, False, found))


def read_config(path: str, base_dir: str = USER_CONFIG_DIR) -> ConfigFile:
    """``path`` parsed with its Includes expanded; DsrunUsageError names the
    file and line of a problem."""
    return read_configs([(path, base_dir)])


def read_configs(files: Sequence[tuple[str, str]]) -> ConfigFile:
    """The files ``(path, directory of its relative Includes)``, in order,
    read as one configuration as OpenSSH reads its user and system files
    (module docstring)."""
    out: list[str] = []
    notes: list[tuple[int, str]] = []  # (index in out of the Match line, note)
    for number, (path, base_dir) in enumerate(files):
        if number:  # a file's lines before its first Host/Match are for every host
            out.append("Host *")
        _expand(path, os.path.expanduser(base_dir), 0, out, notes)
    try:
        config = _RawProxyConfig.from_text("\n".join(out) + "\n")
    except paramiko.ssh_exception.ConfigParseError as exc:
        names = " and ".join(path for path, _ in files)
        raise DsrunUsageError(f"ssh config {names}: {exc}") from None
    return ConfigFile(config, tuple((_block_index(out, line), note) for line, note in notes))


def _block_index(lines: list[str], at: int) -> int:
    """The index, in paramiko's parsed blocks, of the block that starts at
    ``lines[at]`` (block 0 holds what comes before the first Host/Match)."""
    return 1 + sum(1 for line in lines[:at] if _header_key(line))


def _header_key(raw: str) -> bool:
    line = raw.strip()
    match = _LINE.fullmatch(line) if line and not line.startswith("#") else None
    return match is not None and match.group(1).lower() in ("host", "match")


def expand_includes(path: str, base_dir: str = USER_CONFIG_DIR) -> str:
    """The text of ``path`` with every Include replaced by its files' text."""
    out: list[str] = []
    _expand(path, os.path.expanduser(base_dir), 0, out, [])
    return "\n".join(out) + "\n"


def _read_lines(path: str) -> list[str]:
    try:
        with open(path, encoding="utf-8", errors="surrogateescape") as f:
            return f.read().splitlines()
    except OSError as exc:
        raise DsrunUsageError(f"cannot read ssh config {path}: {exc.strerror or exc}") from None


def _expand(path: str, base_dir: str, depth: int, out: list[str],
            notes: list[tuple[int, str]]) -> bool:
    """Append ``path``'s lines to ``out``; True when it (or a file it
    includes) has Host/Match lines."""
    header: str | None = None  # the Host/Match line of the block we are in
    has_blocks = False
    for number, raw in enumerate(_read_lines(path), 1):
        line = raw.strip()
        match = _LINE.fullmatch(line) if line and not line.startswith("#") else None
        key = match.group(1).lower() if match else ""
        if key in ("host", "match"):
            header, has_blocks = line, True
            if key == "match":
                notes.extend((len(out), note) for note in  # this line's index in out
                             _match_notes(match.group(2), f"{path}:{number}"))  # type: ignore[union-attr]
        if key != "include":
            out.append(raw)
            continue
        where = f"{path}:{number}"
        for included in _include_paths(match.group(2), base_dir, where):  # type: ignore[union-attr]
            if depth + 1 >= MAX_INCLUDE_DEPTH:
                raise DsrunUsageError(f"ssh config {where}: Include nested more than "
                                      f"{MAX_INCLUDE_DEPTH} deep (does a file include itself?)")
            mark = len(out)
            if _expand(included, base_dir, depth + 1, out, notes):
                if header is not None and not _all_hosts(header):
                    del out[mark:]
                    raise DsrunUsageError(
                        f"ssh config {where}: the Include inside `{header}` brings Host/Match "
                        f"blocks ({included}); dsrun reads Includes with blocks only outside "
                        f"any Host/Match block: move the Include line above the first Host")
                has_blocks = True
                out.append(header or "Host *")  # the rest of this block stays in it
    return has_blocks


def _all_hosts(header: str) -> bool:
    match = _LINE.fullmatch(header)
    return match is not None and match.group(1).lower() == "host" \
        and match.group(2).split() == ["*"]


def _include_paths(value: str, base_dir: str, where: str) -> list[str]:
    try:
        words = shlex.split(value)
    except ValueError as exc:
        raise DsrunUsageError(f"ssh config {where}: bad Include {value!r}: {exc}") from None
    paths: list[str] = []
    for word in words:
        word = os.path.expanduser(_ENV.sub(lambda m: os.environ.get(m.group(1), ""), word))
        if not os.path.isabs(word):
            word = os.path.join(base_dir, word)
        paths.extend(p for p in sorted(glob.glob(word)) if os.path.isfile(p))
    return paths


def _match_notes(value: str, where: str) -> list[str]:
    try:
        words = shlex.split(value)
    except ValueError:
        return []  # paramiko reports it
    notes = []
    while words:
        word = words.pop(0)
        kind = word.lstrip("!").lower()
        if kind not in _NO_PARAM and words:
            words.pop(0)
        if kind not in PARAMIKO_MATCH:
            notes.append(f"`Match {kind}` ({where}) is not evaluated by dsrun "
                         f"(its block is applied as if it matched)")
    return notes


#: sshd_config(5) TIME FORMATS: a sum of numbers with an optional unit each.
_TIME = re.compile(r"(?:[0-9]+[sSmMhHdDwW]?)+")
_TIME_PART = re.compile(r"([0-9]+)([sSmMhHdDwW]?)")
_UNIT_SECONDS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


def parse_time(text: str) -> int | None:
    """Seconds of an ssh_config time value (``90``, ``30s``, ``1m30s``), as
    OpenSSH's convtime reads it; None when it is not one."""
    if not _TIME.fullmatch(text):
        return None
    return sum(int(n) * _UNIT_SECONDS[unit.lower()] for n, unit in _TIME_PART.findall(text))


def unused_settings(config: Mapping[str, Any]) -> tuple[str, ...]:
    """The settings of one host's lookup that change how OpenSSH connects
    and that dsrun does not use, as ``Key value``."""
    found = []
    for key, value in config.items():
        name = UNUSED_KEYS.get(key)
        text = " ".join(value) if isinstance(value, list) else str(value)
        if name is not None and _HARMLESS.get(key) != text.lower():
            found.append(f"{name} {text}")
    return tuple(sorted(found))
