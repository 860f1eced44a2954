"""known_hosts files read as OpenSSH reads them, line by line.

paramiko's HostKeys.load raises for a whole file at the first line it
cannot read, and it does not know the ``@cert-authority``/``@revoked``
markers: one such line (sites that use host certificates put one in
/etc/ssh/ssh_known_hosts) made every host fail. Here a line that cannot be
read is skipped with a warning naming file:line; marker lines are kept:
``@revoked`` keys are refused, ``@cert-authority`` lines only explain why a
host has no key (dsrun cannot check host certificates).

Keys are compared as their type and wire bytes, so a key type paramiko
cannot load still matches (or is refused) as it should. Host patterns: a
comma list with ``*``/``?`` wildcards and ``!`` negation, case-insensitive,
``[host]:port`` for a port other than 22, and hashed ``|1|salt|hash``
names (``ssh-keyscan -H``).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import logging
import os
import re
import struct
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from functools import lru_cache

MARKERS = ("cert-authority", "revoked")
log = logging.getLogger(__name__)
Warn = Callable[[str], None]


def warn(text: str) -> None:
    """A warning through logging (only the CLI prints)."""
    log.warning("%s", text)


@dataclass(frozen=True)
class KnownKey:
    """One usable known_hosts line."""

    path: str
    line: int
    marker: str  # "" | "cert-authority" | "revoked"
    patterns: str
    keytype: str
    blob: bytes

    @property
    def where(self) -> str:
        return f"{self.path}:{self.line}"

    def matches(self, name: str) -> bool:
        return host_matches(self.patterns, name)

    def same_key(self, keytype: str, blob: bytes) -> bool:
        return self.keytype == keytype and self.blob == blob


def parse_line(text: str, path: str = "", line: int = 0) -> KnownKey | None:
    """The entry of one line; None for a blank or comment line; ValueError
    saying what is wrong with a line that cannot be read."""
    fields = text.split()
    if not fields or fields[0].startswith("#"):
        return None
    marker = ""
    if fields[0].startswith("@"):
        marker = fields.pop(0)[1:]
        if marker not in MARKERS:
            raise ValueError(f"unknown marker @{marker} (known: @cert-authority, @revoked)")
    if len(fields) < 3:
        raise ValueError("expected host patterns, a key type and a base64 key")
    patterns, keytype, data = fields[:3]
    try:
        blob = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise ValueError(f"the {keytype} key is not valid base64") from None
    if _blob_type(blob) != keytype:
        raise ValueError(f"key type {keytype} does not match the key data")
    return KnownKey(path, line, marker, patterns, keytype, blob)


def _blob_type(blob: bytes) -> str | None:
    if len(blob) < 4:
        return None
    (size,) = struct.unpack(">I", blob[:4])
    if size > len(blob) - 4:
        return None
    return blob[4:4 + size].decode("ascii", "replace")


def parse_text(text: str, path: str, warn: Warn = warn) -> tuple[KnownKey, ...]:
    keys = []
    for number, line in enumerate(text.splitlines(), 1):
        try:
            entry = parse_line(line, path, number)
        except ValueError as exc:
            warn(f"known_hosts {path}:{number}: {exc}; line skipped")
            continue
        if entry is not None:
            keys.append(entry)
    return tuple(keys)


_cache: dict[str, tuple[tuple[int, int, int], tuple[KnownKey, ...]]] = {}
_cache_lock = threading.Lock()


def load_file(path: str, warn: Warn = warn) -> tuple[KnownKey, ...]:
    """The entries of one file (none when it does not exist); parsed once
    per version of the file, so its warnings come once for all hosts.
    OSError when it exists but cannot be read."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return ()
    stamp = (st.st_ino, st.st_size, st.st_mtime_ns)
    with _cache_lock:
        cached = _cache.get(path)
        if cached is not None and cached[0] == stamp:
            return cached[1]
        with open(path, "rb") as f:
            text = f.read().decode("utf-8", "replace")
        keys = parse_text(text, path, warn)
        _cache[path] = (stamp, keys)
        return keys


@dataclass(frozen=True)
class KnownHosts:
    keys: tuple[KnownKey, ...] = ()

    @classmethod
    def load(cls, paths: Iterable[str], warn: Warn = warn) -> KnownHosts:
        return cls(tuple(k for p in paths for k in load_file(p, warn)))

    def find(self, names: Sequence[str], marker: str = "") -> list[KnownKey]:
        return [k for k in self.keys if k.marker == marker and any(map(k.matches, names))]

    def first_known(self, names: Sequence[str],
                    fallback: Sequence[str] = ()) -> tuple[str, list[KnownKey], bool]:
        """The first of ``names``, then of ``fallback``, that has plain
        entries: that name, its entries, and whether it is a fallback one
        (``("", [], False)``: none has any)."""
        for group, portless in ((names, False), (fallback, True)):
            for name in group:
                found = self.find([name])
                if found:
                    return name, found, portless
        return "", [], False

    def key_types(self, names: Sequence[str], fallback: Sequence[str] = ()) -> list[str]:
        """Types of the plain keys known under the name the key will be
        judged by (:func:`check_key`), in file order: the host key
        algorithms to ask the server for first."""
        return list(dict.fromkeys(k.keytype for k in self.first_known(names, fallback)[1]))


@dataclass(frozen=True)
class Verdict:
    """ok | revoked | changed | unknown; ``entry``: the line concerned (for
    unknown, a @cert-authority line for the host, if any)."""

    kind: str
    entry: KnownKey | None = None
    name: str = ""  # the name the entry was found under
    portless: bool = False  # found through the port-less fallback


def check_key(known: KnownHosts, names: Sequence[str], fallback: Sequence[str],
              keytype: str, blob: bytes) -> Verdict:
    """Judge a server's key. ``names``: the names it is looked up under, in
    order (``[host]:port`` for a port other than 22); ``fallback``: the
    port-less names tried when none of ``names`` has an entry (as OpenSSH
    does for a non-default port). The first name with entries decides, as
    the HostName's entry decides in OpenSSH: a later name's matching entry
    never outweighs an earlier name's different key (a stale entry under
    another name must not vouch for this address); a different key is a
    changed key, also a port-less one."""
    for entry in known.find([*names, *fallback], "revoked"):
        if entry.same_key(keytype, blob):
            return Verdict("revoked", entry)
    name, plain, portless = known.first_known(names, fallback)
    if plain:
        for entry in plain:
            if entry.same_key(keytype, blob):
                return Verdict("ok", entry, name, portless)
        same_type = [e for e in plain if e.keytype == keytype] or plain
        return Verdict("changed", same_type[0], name, portless)
    authorities = known.find([*names, *fallback], "cert-authority")
    return Verdict("unknown", authorities[0] if authorities else None)


# --------------------------------------------------------------------------
# host patterns


def host_matches(patterns: str, name: str) -> bool:
    """Whether ``name`` matches a known_hosts host field."""
    if patterns.startswith("|"):
        return _hashed_matches(patterns, name)
    name = name.lower()
    found = False
    for pattern in patterns.split(","):
        negated = pattern.startswith("!")
        if _glob(pattern[1:] if negated else pattern).fullmatch(name):
            if negated:
                return False
            found = True
    return found


@lru_cache(maxsize=1024)
def _glob(pattern: str) -> re.Pattern[str]:
    parts = (".*" if c == "*" else "." if c == "?" else re.escape(c) for c in pattern.lower())
    return re.compile("".join(parts), re.DOTALL)


def _hashed_matches(field: str, name: str) -> bool:
    parts = field.split("|")
    if len(parts) != 4 or parts[1] != "1":
        return False
    try:
        salt = base64.b64decode(parts[2], validate=True)
        digest = base64.b64decode(parts[3], validate=True)
    except (binascii.Error, ValueError):
        return False
    mine = hmac.new(salt, name.lower().encode("utf-8"), hashlib.sha1).digest()
    return hmac.compare_digest(mine, digest)
