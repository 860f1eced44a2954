"""Parse, validate, find and edit DeepSpeed-style hostfiles.

A hostfile lists one host per line as ``hostname slots=N``; ``#`` starts a
comment (whole-line or trailing) and blank lines are ignored. Hosts are
RFC 1123 host names (also with '_', as ssh_config aliases and /etc/hosts
names may have), IPv4 or IPv6 addresses. Parsing is strict: every
problem is reported as ``path:line:col: message`` (1-based line and
column), and all problems of a file are reported at once. The syntax
itself (valid hosts and slot counts, line parsing, :func:`hostfile_problems`)
lives in :mod:`dsrun.launcher.hostfile_syntax`; its public names are
importable from here.

Everything here except :func:`read_hostfile_text`, :func:`load_hostfile`
and the path resolution functions is pure. The editing functions
(:func:`add_host`, :func:`remove_host`, :func:`set_slots`,
:func:`format_text`) work on the text lines, so comments, blank lines and
order survive an edit; they refuse to edit an invalid file or to produce
an invalid one.

Hosts are compared by :func:`host_key`: host names case-insensitively (as
DNS does) and addresses by value, so ``Worker-0``/``worker-0`` or
``::1``/``0::1`` are the same host.
"""

from __future__ import annotations

import codecs
import os
from collections.abc import Sequence
from dataclasses import dataclass

from dsrun.errors import HostfileError
from dsrun.launcher.hostfile_syntax import (  # noqa: F401 - public names importable from here
    _SLOTS_PREFIX,
    MAX_SLOTS,
    HostfileProblem,
    _join_lines,
    _Line,
    _loopback_message,
    _parse_lines,
    _problems_error,
    _split_lines,
    did_you_mean,
    host_key,
    host_problem,
    hostfile_problems,
    is_loopback_spelling,
    slots_problem,
)

#: Hostfile a scheduler provides to a job; read when ``./hostfile`` is absent.
#: Looked up at call time, so tests may monkeypatch it.
DEFAULT_JOB_HOSTFILE = "/job/hostfile"
#: Name of the hostfile looked for in the working directory.
LOCAL_HOSTFILE = "hostfile"
#: ``-H`` value that means "no hostfile: this host only" (DeepSpeed runs on
#: this host when its hostfile is not a regular file; ``-H /dev/null`` is
#: the spelling its users use). Any other missing path stays an error.
NO_HOSTFILE = os.devnull


# --------------------------------------------------------------------------
# data


@dataclass(frozen=True)
class HostEntry:
    """One host line: the host as written, its slot count, its 1-based line."""

    host: str
    slots: int
    line: int

    def __post_init__(self) -> None:
        reason = host_problem(self.host)
        if reason is not None:
            raise HostfileError(f"invalid host {self.host!r}: {reason}")
        reason = slots_problem(self.slots)
        if reason is not None:
            raise HostfileError(f"slots of host {self.host!r} {reason}")


@dataclass(frozen=True)
class Hostfile:
    """The hosts of a hostfile in file order; no host appears twice."""

    path: str
    entries: tuple[HostEntry, ...]

    def __post_init__(self) -> None:
        seen: dict[str, HostEntry] = {}
        for entry in self.entries:
            first = seen.setdefault(host_key(entry.host), entry)
            if first is not entry:
                raise HostfileError(
                    f"{self.path}: duplicate host {entry.host!r} "
                    f"(lines {first.line} and {entry.line})"
                )

    @property
    def hosts(self) -> tuple[str, ...]:
        """Host names in file order, as written."""
        return tuple(entry.host for entry in self.entries)

    @property
    def total_slots(self) -> int:
        return sum(entry.slots for entry in self.entries)

    def get(self, host: str) -> HostEntry | None:
        """The entry for ``host`` (compared by :func:`host_key`), or None."""
        key = host_key(host)
        for entry in self.entries:
            if host_key(entry.host) == key:
                return entry
        return None

    def __contains__(self, host: object) -> bool:
        return isinstance(host, str) and self.get(host) is not None

    def __len__(self) -> int:
        return len(self.entries)


def local_hostfile(slots: int, host: str = "localhost") -> Hostfile:
    """A one-host hostfile standing for a local job (no hostfile found)."""
    return Hostfile("<local>", (HostEntry(host, slots, 0),))


def parse_hostfile(text: str, path: str) -> Hostfile:
    """Parse hostfile ``text`` read from ``path`` (used in messages).

    Raises HostfileError listing every problem, one ``path:line:col: msg``
    per line. A file without hosts parses to a Hostfile with no entries.
    """
    parsed, problems = _parse_lines(_split_lines(text)[0], path)
    if problems:
        raise _problems_error(problems)
    entries = tuple(
        HostEntry(line.host, line.slots, line.number)
        for line in parsed
        if line.host is not None and line.slots is not None
    )
    return Hostfile(path, entries)


# --------------------------------------------------------------------------
# editing (pure, on text lines)


def _checked_lines(text: str, path: str) -> tuple[list[str], str, list[_Line]]:
    lines, newline = _split_lines(text)
    parsed, problems = _parse_lines(lines, path)
    if problems:
        raise _problems_error(problems, f"refusing to edit {path}, it has problems:\n")
    return lines, newline, parsed


def _find_host(parsed: Sequence[_Line], host: str) -> _Line | None:
    key = host_key(host)
    for line in parsed:
        if line.host is not None and host_key(line.host) == key:
            return line
    return None


def _require_host(parsed: Sequence[_Line], host: str, path: str) -> _Line:
    line = _find_host(parsed, host)
    if line is None:
        known = [p.host for p in parsed if p.host is not None]
        raise HostfileError(f"host {host!r} is not in {path}{did_you_mean(host, known)}")
    return line


def _check_new_entry(host: str | None, slots: int) -> None:
    if host is not None:
        reason = host_problem(host)
        if reason is not None:
            raise HostfileError(f"invalid host {host!r}: {reason}")
    reason = slots_problem(slots)
    if reason is not None:
        raise HostfileError(f"slots {reason}")


def add_host(text: str, host: str, slots: int, path: str = LOCAL_HOSTFILE) -> str:
    """``text`` with ``host slots=N`` added after the last non-blank line."""
    lines, newline, parsed = _checked_lines(text, path)
    _check_new_entry(host, slots)
    existing = _find_host(parsed, host)
    if existing is not None:
        raise HostfileError(
            f"{path}:{existing.number}: host {existing.host!r} is already listed "
            f"(slots={existing.slots}); use set-slots to change it"
        )
    if is_loopback_spelling(host):
        loopback = [p for p in parsed if p.host is not None and is_loopback_spelling(p.host)]
        if loopback:
            raise HostfileError(f"{path}:{loopback[0].number}: "
                                f"{_loopback_message(host, loopback[0])}")
    end = len(lines)
    while end > 0 and not lines[end - 1].strip():
        end -= 1
    lines.insert(end, f"{host} {_SLOTS_PREFIX}{slots}")
    return _join_lines(lines, newline)


def remove_host(text: str, host: str, path: str = LOCAL_HOSTFILE) -> str:
    """``text`` without the line of ``host`` (its trailing comment goes too).

    The last host is not removed: a hostfile without hosts is refused by
    every job, so the error says to delete the file instead.
    """
    lines, newline, parsed = _checked_lines(text, path)
    line = _require_host(parsed, host, path)
    if all(p.host is None or p is line for p in parsed):
        raise HostfileError(
            f"{line.host!r} is the last host of {path}, and a hostfile without hosts is "
            f"refused by every job: delete {path} instead (jobs then run on this host "
            f"only, unless another hostfile is found)")
    del lines[line.number - 1]
    return _join_lines(lines, newline)


def written_host(text: str, host: str, path: str = LOCAL_HOSTFILE) -> str:
    """``host`` as the hostfile ``text`` spells it (``Worker-1`` for ``worker-1``)."""
    return _require_host(_checked_lines(text, path)[2], host, path).host or host


def set_slots(text: str, host: str, slots: int, path: str = LOCAL_HOSTFILE) -> str:
    """``text`` with the slot count of ``host`` changed in place."""
    lines, newline, parsed = _checked_lines(text, path)
    _check_new_entry(None, slots)
    line = _require_host(parsed, host, path)
    start, end = line.slots_span
    lines[line.number - 1] = f"{line.text[:start]}{_SLOTS_PREFIX}{slots}{line.text[end:]}"
    return _join_lines(lines, newline)


def format_text(text: str, path: str = LOCAL_HOSTFILE) -> str:
    """``text`` normalised: ``host slots=N [# comment]``, comments and blank
    lines kept in place, trailing whitespace and trailing blank lines dropped."""
    lines, newline, parsed = _checked_lines(text, path)
    out: list[str] = []
    for line in parsed:
        if line.host is not None:
            entry = f"{line.host} {_SLOTS_PREFIX}{line.slots}"
            out.append(f"{entry} {line.comment}" if line.comment else entry)
        else:
            out.append(line.comment)
    while out and not out[-1]:
        out.pop()
    return _join_lines(out, newline)


# --------------------------------------------------------------------------
# files (I/O at the edge)


def read_hostfile_text(path: str) -> str:
    """The text of hostfile ``path``; HostfileError if it cannot be read."""
    return read_hostfile_text_bom(path)[0]


def read_hostfile_text_bom(path: str) -> tuple[str, bool]:
    """The text of hostfile ``path`` (without a UTF-8 byte-order mark), and
    whether it started with one: the file is read once (``hosts fmt`` says
    a BOM is to be dropped without opening the file a second time)."""
    try:
        with open(path, "rb") as handle:
            data = handle.read()
        bom = data.startswith(codecs.BOM_UTF8)
        start = len(codecs.BOM_UTF8) if bom else 0
        try:
            return data[start:].decode("utf-8"), bom
        except UnicodeDecodeError as exc:
            raise HostfileError(f"hostfile {path!r} is not UTF-8 text (bad byte at offset "
                                f"{exc.start + start})") from None
    except FileNotFoundError:
        if os.path.islink(path):
            raise HostfileError(f"hostfile {path!r} is a symbolic link to "
                                f"{os.readlink(path)!r}, which does not exist") from None
        raise HostfileError(f"hostfile {path!r} does not exist") from None
    except IsADirectoryError:
        raise HostfileError(f"hostfile {path!r} is a directory, not a file") from None
    except OSError as exc:
        raise HostfileError(f"cannot read hostfile {path!r}: {exc.strerror or exc}") from None


def load_hostfile(path: str) -> Hostfile:
    """Read and parse the hostfile at ``path``."""
    return parse_hostfile(read_hostfile_text(path), path)


def default_hostfile_path(cwd: str) -> str | None:
    """``cwd/hostfile`` if it exists, else :data:`DEFAULT_JOB_HOSTFILE` if
    it exists, else None. Anything by that name counts (a directory, a
    dangling symlink): :func:`resolve_hostfile` then says it was found
    automatically, rather than silently running on this host only."""
    for candidate in (os.path.join(cwd, LOCAL_HOSTFILE), DEFAULT_JOB_HOSTFILE):
        if os.path.lexists(candidate):
            return candidate
    return None


def is_no_hostfile(explicit: str | None, cwd: str = os.curdir) -> bool:
    """Whether ``-H explicit`` is the explicit "no hostfile" (:data:`NO_HOSTFILE`)."""
    return bool(explicit) and os.path.normpath(os.path.join(cwd, explicit)) == NO_HOSTFILE


def _found_automatically(path: str, cwd: str) -> str:
    """Why a hostfile that was not named with -H is used, for its errors."""
    if path == DEFAULT_JOB_HOSTFILE:
        return "the job hostfile, used when ./hostfile is absent"
    return f"found automatically in the working directory {os.path.abspath(cwd)}"


def resolve_hostfile(explicit: str | None, cwd: str) -> Hostfile | None:
    """The hostfile a job uses; None means a local job.

    A hostfile the user named must exist (relative paths are taken from
    ``cwd``); there is no silent fallback, except :data:`NO_HOSTFILE`, the
    explicit "this host only". Otherwise ``cwd/hostfile``, then
    :data:`DEFAULT_JOB_HOSTFILE`, each only when present; one of them that
    cannot be read is an error saying it was found automatically.
    """
    if explicit is not None:
        if not explicit:
            raise HostfileError("the hostfile path is empty")
        if is_no_hostfile(explicit, cwd):
            return None
        return load_hostfile(os.path.join(cwd, explicit))
    found = default_hostfile_path(cwd)
    if found is None:
        return None
    try:
        text = read_hostfile_text(found)
    except HostfileError as exc:
        raise HostfileError(
            f"{exc} ({_found_automatically(found, cwd)}, not named with -H): move it "
            f"away, name a hostfile with -H PATH, or pass -H {NO_HOSTFILE} to run on this "
            f"host only") from None
    return parse_hostfile(text, found)
