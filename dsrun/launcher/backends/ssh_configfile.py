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

The system-wide file is the site's, not the user's: what dsrun cannot read
in it does not stop a launch. A line paramiko cannot parse (or an Include
dsrun cannot expand) skips that file with one warning naming file:line;
a Match block whose criteria dsrun cannot evaluate (``localnetwork``,
``tagged``, ``version``...) is skipped with one warning, as a block that
does not match, rather than applied to every host. ``Match final all``
and ``Match canonical all`` (Fedora/RHEL's stock 50-redhat.conf) are read
as ``Match final`` / ``Match canonical``, which OpenSSH treats the same
and paramiko parses. A problem in the user's own files stays an error.

ProxyCommand and ProxyJump keep their ``%`` tokens here (paramiko would
fill in the config's Port and User, not --ssh_port/--ssh_user): the
connection fills them in (ssh_proxy.py).

What dsrun cannot honour is collected as notes that connection errors
quote: ``Match`` criteria paramiko does not know in the user's files (it
treats them as matching; noted for the hosts whose lookup applied that
block), and, per host, settings that change how to connect
(:func:`unused_settings`): listed when the user's files set them, only
counted when they come from the system-wide file alone (the crypto-policy
Ciphers, KexAlgorithms, MACs... of RHEL-family hosts).
"""

from __future__ import annotations

import glob
import logging
import os
import re
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
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
#: Key of a lookup result naming the keys that only the system-wide file
#: set, and that file: ``(path, keys)`` (no ssh_config key has a space).
SITE_KEYS = "dsrun site keys"

log = logging.getLogger(__name__)
_warned: set[str] = set()

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


def _warn_once(text: str) -> None:
    """A warning through logging, once per process (lookups are per host)."""
    if text not in _warned:
        _warned.add(text)
        log.warning("%s", text)


@dataclass(frozen=True)
class ConfigFile:
    """A parsed ssh_config and what in it dsrun cannot evaluate."""

    config: paramiko.SSHConfig
    #: (index of the Match block in paramiko's parsed blocks, its note)
    match_notes: tuple[tuple[int, str], ...] = ()
    #: the system-wide file read after the user's, and the keys only it sets
    site: str | None = None
    site_keys: frozenset[str] = frozenset()

    def lookup(self, host: str) -> dict[str, Any]:
        found = dict(self.config.lookup(host))
        if self.site is not None and self.site_keys:
            found[SITE_KEYS] = (self.site, self.site_keys)
        return found

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


def read_configs(files: Sequence[tuple[str, str]],
                 site: tuple[str, str] | None = None) -> ConfigFile:
    """The files ``(path, directory of its relative Includes)``, in order,
    read as one configuration as OpenSSH reads its user and system files
    (module docstring); ``site``, the system-wide file, comes last and
    what dsrun cannot read in it is skipped with a warning."""
    out = _Out()
    for number, (path, base_dir) in enumerate(files):
        if number:  # a file's lines before its first Host/Match are for every host
            out.add("Host *", path)
        _expand(path, os.path.expanduser(base_dir), 0, out)
    user = _parse(out)
    notes = tuple((_block_index(out.lines, line), note) for line, note in out.notes)
    if site is None:
        return ConfigFile(user, notes)
    mark = len(out.lines)
    try:
        if files:
            out.add("Host *", site[0])
        _expand(site[0], os.path.expanduser(site[1]), 0, out, site=True)
        config = _parse(out)
    except DsrunUsageError as exc:
        _warn_once(f"{exc}; dsrun skips the system-wide {site[0]} (--ssh_config FILE "
                   f"reads FILE alone)")
        return ConfigFile(user, notes)
    start = _block_index(out.lines, mark) if files else 0  # the site file's first block
    return ConfigFile(config, notes, site[0], _keys(config, start) - _keys(user, 0))


def _keys(config: paramiko.SSHConfig, start: int) -> frozenset[str]:
    """The keys set in parsed blocks ``start`` and after."""
    return frozenset(k for block in config._config[start:] for k in block["config"])


@dataclass
class _Out:
    """The expanded text: its lines, where each came from (``file:line``),
    and the notes of Match lines (index of the line, note)."""

    lines: list[str] = field(default_factory=list)
    origins: list[str] = field(default_factory=list)
    notes: list[tuple[int, str]] = field(default_factory=list)

    def add(self, line: str, where: str) -> None:
        self.lines.append(line)
        self.origins.append(where)


def _parse(out: _Out) -> paramiko.SSHConfig:
    """paramiko's parse of ``out``; DsrunUsageError names the file and line
    it refused (paramiko's error does not)."""
    try:
        return _RawProxyConfig.from_text("\n".join(out.lines) + "\n")
    except paramiko.ssh_exception.ConfigParseError as exc:
        low, high = 0, len(out.lines)  # parsing lines[:high] fails, lines[:low] does not
        while high - low > 1:
            mid = (low + high) // 2
            try:
                _RawProxyConfig.from_text("\n".join(out.lines[:mid]) + "\n")
                low = mid
            except paramiko.ssh_exception.ConfigParseError:
                high = mid
        raise DsrunUsageError(f"ssh config {out.origins[high - 1]}: {exc}") from None


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
    out = _Out()
    _expand(path, os.path.expanduser(base_dir), 0, out)
    return "\n".join(out.lines) + "\n"


def _read_lines(path: str) -> list[str]:
    try:
        with open(path, encoding="utf-8", errors="surrogateescape") as f:
            return f.read().splitlines()
    except OSError as exc:
        raise DsrunUsageError(f"cannot read ssh config {path}: {exc.strerror or exc}") from None


def _expand(path: str, base_dir: str, depth: int, out: _Out, site: bool = False) -> bool:
    """Append ``path``'s lines to ``out``; True when it (or a file it
    includes) has Host/Match lines. ``site``: the system-wide file, whose
    Match blocks with criteria dsrun cannot evaluate are left out."""
    header: str | None = None  # the Host/Match line of the block we are in
    has_blocks = skipping = False
    for number, raw in enumerate(_read_lines(path), 1):
        line = raw.strip()
        match = _LINE.fullmatch(line) if line and not line.startswith("#") else None
        key = match.group(1).lower() if match else ""
        where = f"{path}:{number}"
        if key in ("host", "match"):
            has_blocks, skipping = True, False
            if key == "match":
                raw = line = _plain_match(raw, match.group(2))  # type: ignore[union-attr]
                unknown = _unknown_criteria(match.group(2))  # type: ignore[union-attr]
                if site and unknown:
                    skipping = True
                    _warn_once(f"ssh config {where}: dsrun cannot evaluate `Match "
                               f"{' '.join(unknown)}`; it skips this block, as one that "
                               f"does not match")
                    continue
                out.notes.extend((len(out.lines), f"`Match {kind}` ({where}) is not "
                                  f"evaluated by dsrun (its block is applied as if it "
                                  f"matched)") for kind in unknown)
            header = line
        if skipping:
            continue
        if key != "include":
            out.add(raw, where)
            continue
        for included in _include_paths(match.group(2), base_dir, where):  # type: ignore[union-attr]
            if depth + 1 >= MAX_INCLUDE_DEPTH:
                raise DsrunUsageError(f"ssh config {where}: Include nested more than "
                                      f"{MAX_INCLUDE_DEPTH} deep (does a file include itself?)")
            if _expand(included, base_dir, depth + 1, out, site):
                if header is not None and not _all_hosts(header):
                    raise DsrunUsageError(
                        f"ssh config {where}: the Include inside `{header}` brings Host/Match "
                        f"blocks ({included}); dsrun reads Includes with blocks only outside "
                        f"any Host/Match block: move the Include line above the first Host")
                has_blocks = True
                out.add(header or "Host *", where)  # the rest of this block stays in it
    return has_blocks


def _plain_match(raw: str, value: str) -> str:
    """``raw``, with ``Match final all`` / ``Match canonical all`` written as
    ``Match final`` / ``Match canonical``: the same to OpenSSH (``all``
    may follow only those), but paramiko refuses the first form."""
    words = value.split()
    if len(words) > 1 and words[-1].lower() == "all" \
            and all(w.lower() in ("canonical", "final") for w in words[:-1]):
        return f"Match {' '.join(words[:-1])}"
    return raw


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


def _unknown_criteria(value: str) -> list[str]:
    """The criteria of a Match line that paramiko does not evaluate."""
    try:
        words = shlex.split(value)
    except ValueError:
        return []  # paramiko reports it
    unknown = []
    while words:
        word = words.pop(0)
        kind = word.lstrip("!").lower()
        if kind not in _NO_PARAM and words:
            words.pop(0)
        if kind not in PARAMIKO_MATCH:
            unknown.append(kind)
    return unknown


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
    and that dsrun does not use, as ``Key value``; those that only the
    system-wide file sets (SITE_KEYS) are counted, not listed."""
    site, site_keys = config.get(SITE_KEYS, ("", frozenset()))
    found, from_site = [], 0
    for key, value in config.items():
        name = UNUSED_KEYS.get(key)
        text = " ".join(value) if isinstance(value, list) else str(value)
        if name is None or _HARMLESS.get(key) == text.lower():
            continue
        if key in site_keys:
            from_site += 1
        else:
            found.append(f"{name} {text}")
    if from_site:
        found.append(f"{from_site} setting{'s' if from_site > 1 else ''} of the system-wide "
                     f"{site} (not listed)")
    return tuple(sorted(found))
