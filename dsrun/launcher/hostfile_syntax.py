"""The syntax of a hostfile: valid hosts and slot counts, and its lines parsed.

A hostfile lists one host per line as ``hostname slots=N``; ``#`` starts a
comment (whole-line or trailing) and blank lines are ignored. Hosts are
RFC 1123 host names (also with '_', as ssh_config aliases and /etc/hosts
names may have, and absolute with a trailing '.'), IPv4 or IPv6 addresses
(an IPv6 scope id only an interface name or number; :func:`host_problem`),
compared by :func:`host_key`. Every line is parsed into a :class:`_Line`, and every
problem of a text is collected at once as a :class:`HostfileProblem`
(``path:line:col: message``). Everything here is pure;
:mod:`dsrun.launcher.hostfile` builds :class:`~dsrun.launcher.hostfile.Hostfile`
objects and edits files on top of it, and re-exports the public names.
"""

from __future__ import annotations

import difflib
import ipaddress
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from dsrun.errors import HostfileError
from dsrun.launcher.netinfo import LOOPBACK_NAMES, is_loopback

_TOKEN = re.compile(r"\S+")
_DIGITS = re.compile(r"[0-9]+", re.ASCII)
# RFC 1123 labels, plus '_': ssh_config and docker-compose aliases and
# /etc/hosts entries often hold one, and DeepSpeed accepts them.
_LABEL = re.compile(r"[A-Za-z0-9_](?:[A-Za-z0-9_-]*[A-Za-z0-9_])?", re.ASCII)
_DOTTED_NUMBERS = re.compile(r"[0-9.]+", re.ASCII)
# An IPv6 scope id: an interface name (Linux allows up to 15 bytes, any but
# '/', ':' and whitespace; these are the characters real names use) or an
# interface index. ipaddress takes any text after '%', so 'fe80::1%eth0 '
# or one holding a newline or '#' would pass and break the hostfile line.
_SCOPE_ID = re.compile(r"[A-Za-z0-9_.-]{1,64}", re.ASCII)
_SLOTS_PREFIX = "slots="
#: The most slots (ranks) one host may have. The largest GPU boards hold 8 to
#: 16 GPUs (DGX/HGX), and a CPU host's slots count CPU ranks, one per core at
#: most; 1024 is above both, so a larger count is a typo (and dsrun would
#: build a rank table of that size before noticing).
MAX_SLOTS = 1024


@dataclass(frozen=True)
class HostfileProblem:
    """One error in a hostfile; ``str()`` gives ``path:line:col: message``."""

    path: str
    line: int
    col: int
    message: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}:{self.col}: {self.message}"


# --------------------------------------------------------------------------
# host names


def host_problem(host: str) -> str | None:
    """Why ``host`` is not a valid host name or IP address, or None if it is."""
    if host.startswith("[") and host.endswith("]"):
        return "write IPv6 addresses without brackets"
    user, at, name = host.rpartition("@")
    if user and name:
        return (f"'USER@HOST' is not supported: write the host alone ({name}) and give the "
                f"user with --ssh_user {user} or as 'User {user}' for it in ssh_config")
    name, colon, port = host.partition(":")
    if colon and name and port.isascii() and port.isdigit():  # IPv6 has 2+ colons
        return (f"HOST:PORT is not supported (put the port in ssh_config: "
                f"'Host {name}' / 'Port {port}', or pass --ssh_port)")
    if ":" in host:
        return _ipv6_problem(host)
    if "." in host and _DOTTED_NUMBERS.fullmatch(host):
        try:
            ipaddress.IPv4Address(host)
        except ValueError:
            return "not a valid IPv4 address"
        return None
    return _name_problem(host)


def _ipv6_problem(host: str) -> str | None:
    """Why ``host`` (it holds a ':') is not an IPv6 address, or None."""
    address, percent, scope = host.partition("%")
    if percent and not _SCOPE_ID.fullmatch(scope):
        return (f"scope id {scope!r} of IPv6 address {address!r} is not an interface name "
                f"or number (letters, digits, '_', '.' and '-')")
    try:
        ipaddress.IPv6Address(host)
    except ValueError:
        return "not a valid IPv6 address"
    return None


def _name_problem(host: str) -> str | None:
    """Why ``host`` is not a host name, or None. One trailing '.' (an
    absolute DNS name, ``node1.example.org.``) is allowed, as ssh and
    DeepSpeed allow it."""
    name = host[:-1] if host.endswith(".") and host != "." else host
    if len(name) > 253:
        return "longer than 253 characters"
    for label in name.split("."):
        if not label:
            return "empty label (leading, trailing or doubled '.')"
        if len(label) > 63:
            return f"label {label!r} is longer than 63 characters"
        if not _LABEL.fullmatch(label):
            return (
                f"label {label!r} may only hold letters, digits, '-' and '_', "
                "and must not start or end with '-'"
            )
    return None


def slots_problem(slots: object) -> str | None:
    """Why ``slots`` is not a slot count (``must be ...``), or None if it is."""
    if isinstance(slots, bool) or not isinstance(slots, int) or slots < 1:
        return f"must be a positive integer, got {slots!r}"
    if slots > MAX_SLOTS:
        return f"must be at most {MAX_SLOTS} (no host runs more ranks), got {slots}"
    return None


def host_key(host: str) -> str:
    """Identity of a host: lower-case name or normalised address. An
    absolute name is the same host as its relative spelling (``beta.`` and
    ``beta``: one DNS host), so the two are duplicates."""
    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        return host.lower().removesuffix(".") if host != "." else host


def is_loopback_spelling(host: str) -> bool:
    """Whether ``host`` is this machine by its spelling alone: ``localhost``
    (and its usual aliases) or a loopback address (``127.*``, ``::1``)."""
    return host.lower().rstrip(".") in LOOPBACK_NAMES or is_loopback(host)


def did_you_mean(name: str, choices: Iterable[str]) -> str:
    """`` (did you mean 'x'?)`` for the closest choice, or an empty string."""
    close = difflib.get_close_matches(name, list(choices), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


# --------------------------------------------------------------------------
# parsing


@dataclass(frozen=True)
class _Line:
    """One parsed text line; ``host`` is None for blank and comment lines."""

    number: int
    text: str
    host: str | None = None
    host_col: int = 0
    slots: int | None = None
    slots_span: tuple[int, int] = (0, 0)  # 0-based [start, end) of 'slots=N'
    comment: str = ""
    problems: tuple[tuple[int, str], ...] = ()  # (column, message)


def _split_lines(text: str) -> tuple[list[str], str]:
    """Text lines without their endings, and the newline style to write."""
    newline = "\r\n" if "\r\n" in text else "\n"
    lines = [line[:-1] if line.endswith("\r") else line for line in text.split("\n")]
    if lines and lines[-1] == "":
        lines.pop()
    return lines, newline


def _join_lines(lines: Sequence[str], newline: str) -> str:
    return "".join(line + newline for line in lines)


def _parse_slots(start: int, token: str) -> tuple[int | None, tuple[int, str] | None]:
    """Slot count of a ``slots=N`` token starting at 0-based ``start``."""
    if not token.startswith(_SLOTS_PREFIX):
        return None, (start + 1, f"expected 'slots=N' after the host, got {token!r}")
    value = token[len(_SLOTS_PREFIX):]
    col = start + len(_SLOTS_PREFIX) + 1
    if not _DIGITS.fullmatch(value) or not value.strip("0"):
        return None, (col, f"slots must be a positive integer, got {value!r}")
    digits = value.lstrip("0")
    if len(digits) > len(str(MAX_SLOTS)):  # int() of thousands of digits raises
        shown = digits if len(digits) <= 30 else f"a {len(digits)}-digit number"
        return None, (col, f"slots must be at most {MAX_SLOTS} (no host runs more ranks), "
                           f"got {shown}")
    count = int(digits)
    reason = slots_problem(count)
    if reason is not None:
        return None, (col, f"slots {reason}")
    return count, None


def _parse_line(number: int, text: str) -> _Line:
    body, hash_mark, rest = text.partition("#")
    comment = (hash_mark + rest).strip()
    tokens = [(m.start(), m.group()) for m in _TOKEN.finditer(body)]
    if not tokens:
        return _Line(number, text, comment=comment)
    problems: list[tuple[int, str]] = []
    host_start, host = tokens[0]
    reason = host_problem(host)
    if reason is not None:
        problems.append((host_start + 1, f"invalid host {host!r}: {reason}"))
    slots: int | None = None
    span = (0, 0)
    if len(tokens) == 1:
        col = host_start + len(host) + 1
        problems.append((col, f"missing 'slots=N' after host {host!r}"))
    else:
        start, token = tokens[1]
        span = (start, start + len(token))
        slots, problem = _parse_slots(start, token)
        if problem is not None:
            problems.append(problem)
    if len(tokens) > 2:
        junk_start = tokens[2][0]
        junk = body[junk_start:].rstrip()
        hint = " (Open MPI's max_slots= is not a hostfile key here: remove it)" \
            if junk.startswith("max_slots") else ""
        problems.append((junk_start + 1, f"unexpected text after slots: {junk!r}{hint}"))
    return _Line(number, text, host, host_start + 1, slots, span, comment, tuple(problems))


def _parse_lines(lines: Sequence[str], path: str) -> tuple[list[_Line], list[HostfileProblem]]:
    """Parse every line; also report hosts that appear twice."""
    parsed = [_parse_line(number, text) for number, text in enumerate(lines, start=1)]
    problems: list[HostfileProblem] = []
    first_seen: dict[str, _Line] = {}
    for line in parsed:
        problems.extend(HostfileProblem(path, line.number, col, msg) for col, msg in line.problems)
        if line.host is None or host_problem(line.host) is not None:
            continue
        first = first_seen.setdefault(host_key(line.host), line)
        if first is not line:
            spelled = "" if first.host == line.host else f" as {first.host!r}"
            message = f"duplicate host {line.host!r} (already on line {first.number}{spelled})"
            problems.append(HostfileProblem(path, line.number, line.host_col, message))
    problems.sort(key=lambda p: (p.line, p.col))
    return parsed, problems


def hostfile_problems(text: str, path: str) -> list[HostfileProblem]:
    """Every problem in hostfile ``text``, in file order (empty if valid).

    Beyond what parsing rejects, two entries that are this machine by their
    spelling alone (``localhost`` and ``127.0.0.1``) are a problem here: a
    job selecting both refuses them, so ``dsrun hosts validate`` says so
    without a network lookup (jobs check names and addresses too).
    """
    parsed, problems = _parse_lines(_split_lines(text)[0], path)
    problems += _loopback_twice(parsed, path)
    problems.sort(key=lambda p: (p.line, p.col))
    return problems


def _loopback_message(host: str, first: _Line) -> str:
    """The problem of a second loopback entry ``host`` (``first``: the
    entry that already named this machine)."""
    return (f"host {host!r} is this machine, as {first.host!r} on line {first.number} is "
            f"(both loopback): list this machine once")


def _loopback_twice(parsed: Sequence[_Line], path: str) -> list[HostfileProblem]:
    """The second and later entries that are loopback by their spelling."""
    first: _Line | None = None
    problems = []
    for line in parsed:
        if line.host is None or not is_loopback_spelling(line.host):
            continue
        if first is None:
            first = line
        elif host_key(line.host) != host_key(first.host):  # the same: a duplicate already
            problems.append(HostfileProblem(path, line.number, line.host_col,
                                            _loopback_message(line.host, first)))
    return problems


def _problems_error(problems: Sequence[HostfileProblem], prefix: str = "") -> HostfileError:
    return HostfileError(prefix + "\n".join(str(p) for p in problems))
