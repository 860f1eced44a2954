"""Finding and stopping every process of a job on this host.

A job's processes are (a) the members of each rank's process group - every
rank is a group leader - (b) any process whose environment carries the
``DSRUN_AGENT_ID`` marker its node agent gave it, which catches descendants
that left the group (``setsid``, daemonising), and (c) on Linux, every
descendant of the node agent but its guard: the agent is a child subreaper,
so a descendant that left both group and environment (``setsid env -i``)
is reparented to it when its parent exits, never to init; the agent tells
its guard those of them that are in no rank's group (:func:`outside_groups`),
so the guard, which is no ancestor of theirs, still finds them (and their
descendants) after the agent is killed. The marker is per agent, not
per job, so that agents of one job whose hosts share a PID namespace never
stop each other's ranks. Stopping is SIGTERM, a deadline, SIGKILL, then a
re-scan until nothing is found, since a dying process may fork.

Only this job's processes are ever touched. Every process is known as a
:class:`Proc` - its pid *and* its start time - and is signalled only while
the pid still names the process that was found (through a pidfd where the
kernel has them, so the check and the signal cannot be told apart by a
reused pid). A rank's group is signalled, or its members matched by group
id, only while its leader is still the rank that was started: a pid, once
its process is reaped, may be given to someone else's process, which may
lead a group of its own. The node agent keeps each exited rank unreaped (a
zombie holds its pid and its group id) until the teardown is over; the
guard, which cannot do that, relies on the start-time check.

Linux: read from ``/proc`` directly (the agent does not import psutil, which
costs more than the scan). Elsewhere psutil gives the same facts.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Iterable, Iterator
from typing import NamedTuple

JOB_MARKER = "DSRUN_AGENT_ID"
_HAVE_PROC = os.path.exists("/proc/self/stat")


class Proc(NamedTuple):
    """A process as found: pid and start time (which a reused pid does not share)."""

    pid: int
    started: float

    @classmethod
    def of(cls, pid: int) -> Proc | None:
        """The process ``pid`` as it is now (None: gone)."""
        facts = _facts(pid)
        return None if facts is None else cls(pid, facts[2])

    def ours(self) -> bool:
        """Whether ``pid`` still names this process (also as an unreaped
        zombie, which still holds its group id)."""
        facts = _facts(self.pid)
        return facts is not None and facts[2] == self.started

    def line(self) -> str:
        return f"{self.pid} {self.started!r}"

    @classmethod
    def parse(cls, line: str) -> Proc | None:
        parts = line.split()
        try:
            return cls(int(parts[0]), float(parts[1])) if len(parts) == 2 else None
        except ValueError:
            return None


#: A rank process (a group leader) as its agent started it.
Leader = Proc


def _facts(pid: int) -> tuple[bool, int, float] | None:
    """(zombie, process group, start time) of ``pid``; None if it is gone."""
    stat = _stat(pid)
    return None if stat is None else (stat[0], stat[2], stat[3])


def _stat(pid: int) -> tuple[bool, int, int, float] | None:
    """(zombie, parent pid, process group, start time) of ``pid``; None if gone."""
    if _HAVE_PROC:
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
        except (OSError, IndexError):
            return None
        return fields[0] == b"Z", int(fields[1]), int(fields[2]), float(fields[19])
    import psutil

    try:
        proc = psutil.Process(pid)
        return (proc.status() == psutil.STATUS_ZOMBIE, proc.ppid(), os.getpgid(pid),
                proc.create_time())
    except (psutil.Error, OSError):
        return None


def _pids() -> Iterator[int]:
    if _HAVE_PROC:
        return (int(name) for name in os.listdir("/proc") if name.isdigit())
    import psutil

    return iter(psutil.pids())


def _has_marker(pid: int, marker: str) -> bool:
    if _HAVE_PROC:
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                data = f.read()
        except OSError:
            return False
        return f"\0{JOB_MARKER}={marker}\0".encode() in b"\0" + data
    import psutil

    try:
        return psutil.Process(pid).environ().get(JOB_MARKER) == marker
    except (psutil.Error, OSError):
        return False


def _environ_value(pid: int, name: str) -> str | None:
    """``name`` in the environment ``pid`` started with (None: unset, unreadable)."""
    if _HAVE_PROC:
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                entries = f.read().split(b"\0")
        except OSError:
            return None
        key = name.encode() + b"="
        found = next((e[len(key):] for e in entries if e.startswith(key)), None)
        return None if found is None else found.decode("utf-8", "replace")
    import psutil

    try:
        return psutil.Process(pid).environ().get(name)
    except (psutil.Error, OSError):
        return None


def _command(pid: int) -> str:
    """The command line of ``pid`` (its name when it has none)."""
    if _HAVE_PROC:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = [a for a in f.read().split(b"\0") if a]
            if not argv:
                with open(f"/proc/{pid}/comm", "rb") as f:
                    argv = [f.read().strip()]
        except OSError:
            return "?"
        return " ".join(a.decode("utf-8", "replace") for a in argv)
    import psutil

    try:
        proc = psutil.Process(pid)
        return " ".join(proc.cmdline()) or proc.name()
    except (psutil.Error, OSError):
        return "?"


class Described(NamedTuple):
    """What a teardown can say about a process it stops (read while it lives)."""

    proc: Proc
    command: str  # its command line
    group: int | None  # its process group
    rank: str | None  # ``RANK`` in its environment: inherited from the rank that made it


def describe(proc: Proc) -> Described:
    """``proc`` as :class:`Described`, read now."""
    facts = _facts(proc.pid)
    return Described(proc, _command(proc.pid), None if facts is None else facts[1],
                     _environ_value(proc.pid, "RANK"))


def live_groups(leaders: Iterable[Proc]) -> list[int]:
    """Group ids of ``leaders`` that are still ours (see the module docstring)."""
    return [leader.pid for leader in leaders if leader.ours()]


def job_processes(leaders: Iterable[Proc], marker: str | None,
                  since: float = 0.0, spare: frozenset[int] | None = None,
                  roots: Iterable[Proc] = ()) -> list[Proc]:
    """Live (non-zombie) processes of this job, excluding the caller.

    ``since``: the start time (as :class:`Proc` has it) of the agent; every
    process of the job started later, so older ones are not even read.
    ``spare``: None, or the caller is the job's subreaper (the node agent:
    become_subreaper) and every descendant of it is the job's too, but the
    processes in ``spare`` (its guard) and theirs: this finds those that
    dropped the marker with their environment (``env -i``, daemonisers).
    ``roots``: processes known to be the job's (the guard's record of them:
    :func:`outside_groups`); each, while still ours, and its descendants.
    """
    return [proc for proc, _ in _scan(set(live_groups(leaders)), marker, since, spare,
                                      roots)]


def _scan(groups: set[int], marker: str | None, since: float,
          spare: frozenset[int] | None = None,
          roots: Iterable[Proc] = ()) -> list[tuple[Proc, int]]:
    """The job's live processes (:func:`job_processes`) with their process
    group, read in the same pass."""
    me = os.getpid()
    seen: dict[int, tuple[bool, int, int, float]] = {}
    for pid in _pids():
        stat = _stat(pid)
        if pid != me and stat is not None and stat[3] >= since:
            seen[pid] = stat
    tree = _descendants(me, seen, spare) if spare is not None else set()
    for root in roots:
        if root.pid in seen and seen[root.pid][3] == root.started:
            tree |= {root.pid} | _descendants(root.pid, seen, frozenset())
    found = []
    for pid, (zombie, _, pgid, started) in seen.items():
        if zombie:
            continue
        if pgid in groups or pid in tree or (marker and _has_marker(pid, marker)):
            found.append((Proc(pid, started), pgid))
    return found


def _descendants(root: int, seen: dict[int, tuple[bool, int, int, float]],
                 spare: frozenset[int]) -> set[int]:
    """Pids in ``seen`` below ``root`` (by parent pid), not below ``spare``."""
    children: dict[int, list[int]] = {}
    for pid, stat in seen.items():
        children.setdefault(stat[1], []).append(pid)
    found: set[int] = set()
    todo = [root]
    while todo:
        for child in children.get(todo.pop(), ()):
            if child not in spare and child not in found:
                found.add(child)
                todo.append(child)
    return found


def outside_groups(groups: Iterable[int], spare: Iterable[int]) -> list[Proc]:
    """This process's descendants (but ``spare`` and theirs) that are in none
    of ``groups``: those a rank's group does not hold, found by walking the
    tree from here (``/proc/PID/task/*/children``: only the job's processes
    are read, however many others the host runs). Linux only: [] elsewhere."""
    if not _HAVE_PROC:
        return []
    groups, skip = set(groups), set(spare)
    found: list[Proc] = []
    todo = [pid for pid in _child_pids(os.getpid()) if pid not in skip]
    seen: set[int] = set()
    while todo:
        pid = todo.pop()
        if pid in seen:
            continue
        seen.add(pid)
        stat = _stat(pid)
        if stat is None or stat[0]:
            continue
        if stat[2] not in groups:
            found.append(Proc(pid, stat[3]))
        todo.extend(_child_pids(pid))
    return found


def become_subreaper() -> bool:
    """Make this process the reaper of its orphaned descendants (Linux
    PR_SET_CHILD_SUBREAPER): a process a rank starts in a new session with a
    cleared environment (``setsid env -i``, a double fork) is then still
    below the agent when the rank is gone, so the teardown finds it. False
    where the kernel (or the platform) has no such thing."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(36, 1, 0, 0, 0) == 0  # PR_SET_CHILD_SUBREAPER
    except (OSError, AttributeError):
        return False


def reap_adopted(keep: Iterable[int]) -> int:
    """Reap this process's zombie children but ``keep`` (the ranks, which
    stay unreaped until the teardown, and the guard: their statuses are
    subprocess's and the agent's): orphans a subreaper adopted. How many."""
    me, kept = os.getpid(), set(keep)
    reaped = 0
    for pid in _child_pids(me):
        if pid in kept:
            continue
        stat = _stat(pid)
        if stat is None or not stat[0] or stat[1] != me:
            continue
        try:
            if os.waitpid(pid, os.WNOHANG)[0] == pid:
                reaped += 1
        except ChildProcessError:
            pass
    return reaped


def _child_pids(parent: int) -> list[int]:
    try:
        tasks = os.listdir(f"/proc/{parent}/task")
    except OSError:
        return []
    pids: list[int] = []
    for tid in tasks:
        try:
            with open(f"/proc/{parent}/task/{tid}/children", "rb") as f:
                pids.extend(int(p) for p in f.read().split())
        except (OSError, ValueError):
            continue
    return pids


def send(proc: Proc, sig: int) -> None:
    """``sig`` to ``proc`` if its pid still names it."""
    try:
        fd = os.pidfd_open(proc.pid)
    except (AttributeError, OSError) as exc:
        if isinstance(exc, ProcessLookupError):
            return
        if proc.ours():  # no pidfds here: check, then signal
            try:
                os.kill(proc.pid, sig)
            except (ProcessLookupError, PermissionError):
                pass
        return
    try:
        if proc.ours():  # the pidfd pins the process: no reuse after this check
            signal.pidfd_send_signal(fd, sig)
    except (ProcessLookupError, PermissionError):
        pass
    finally:
        os.close(fd)


def signal_groups(leaders: Iterable[Proc], sig: int) -> None:
    """``sig`` to the group of every leader that is still ours."""
    _killpgs(live_groups(leaders), sig)


def _killpgs(groups: Iterable[int], sig: int) -> None:
    for pgid in groups:
        try:
            os.killpg(pgid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def signal_job(leaders: Iterable[Proc], marker: str | None, sig: int,
               since: float = 0.0, spare: frozenset[int] | None = None,
               others: int | None = None, deaf: Iterable[Proc] = ()) -> None:
    """Send ``sig`` to each group and ``others`` (default: ``sig``) to every
    other process of the job (marked, or below the subreaper: see
    :func:`job_processes`), and to the groups of the leaders in ``deaf``
    (ranks that ignore ``sig``)."""
    groups = set(live_groups(leaders))
    swapped = groups & set(live_groups(deaf))
    _killpgs(groups - swapped, sig)
    _killpgs(swapped, sig if others is None else others)
    for proc, pgid in _scan(groups, marker, since, spare):
        if pgid not in groups:  # a group member got its group's signal: once is enough
            send(proc, sig if others is None else others)


def stop_job(leaders: Iterable[Proc], marker: str | None, grace: float, *,
             already_termed: bool = False, deadline: float | None = None,
             since: float = 0.0, hurry: Callable[[], bool] | None = None,
             spare: frozenset[int] | None = None,
             before_kill: Callable[[Proc], None] | None = None) -> int:
    """Stop every process of the job; return how many needed SIGKILL.

    ``deadline`` (a ``time.monotonic()`` value) overrides ``grace`` when the
    caller already sent SIGTERM earlier and the grace period is running.
    ``hurry``: once it returns True, the grace is over (SIGKILL at once).
    ``spare``: see :func:`job_processes`; ``before_kill``: see :func:`kill_job`.
    """
    leaders = list(leaders)
    procs = job_processes(leaders, marker, since, spare)
    if not procs:
        return 0
    if not already_termed:
        signal_job(leaders, marker, signal.SIGTERM, since, spare)
    end = time.monotonic() + grace if deadline is None else deadline
    while time.monotonic() < end and not (hurry is not None and hurry()):
        if not job_processes(leaders, marker, since, spare):
            return 0
        time.sleep(0.05)
    return kill_job(leaders, marker, since=since, spare=spare, before_kill=before_kill)


def _gone(proc: Proc) -> bool:
    facts = _facts(proc.pid)
    return facts is None or facts[0] or facts[2] != proc.started


def kill_job(leaders: Iterable[Proc], marker: str | None, rounds: int = 20,
             since: float = 0.0, spare: frozenset[int] | None = None,
             roots: Iterable[Proc] = (),
             before_kill: Callable[[Proc], None] | None = None) -> int:
    """SIGKILL every process of the job until a scan finds none
    (``roots``: see :func:`job_processes`); ``before_kill`` sees each one
    first, while it can still be read."""
    leaders, roots = list(leaders), list(roots)
    killed: set[int] = set()
    for _ in range(rounds):
        procs = job_processes(leaders, marker, since, spare, roots)
        if not procs:
            break
        for proc in procs if before_kill is not None else ():
            if proc.pid not in killed:
                before_kill(proc)
        signal_groups(leaders, signal.SIGKILL)
        for proc in procs:
            send(proc, signal.SIGKILL)
        killed.update(p.pid for p in procs)
        end = time.monotonic() + 0.5
        while time.monotonic() < end and not all(_gone(p) for p in procs):
            time.sleep(0.01)
    return len(killed)


def _mask_bit(sig: int) -> int:
    return 1 << (int(sig) - 1)


def _status_masks(path: str, names: tuple[str, ...]) -> dict[str, int]:
    """The signal masks ``names`` (``SigIgn``, ``SigBlk``, ...) of a
    ``/proc/.../status`` file; {} if it cannot be read."""
    found: dict[str, int] = {}
    try:
        with open(path, "rb") as f:
            for line in f:
                key, _, value = line.partition(b":")
                if key.decode() in names:
                    found[key.decode()] = int(value.strip(), 16)
    except (OSError, ValueError):
        return {}
    return found


def ignores(pid: int, sig: int) -> bool:
    """Whether process ``pid`` ignores ``sig`` (SIG_IGN: ``SigIgn`` in
    /proc; False where it cannot be read)."""
    return bool(_status_masks(f"/proc/{pid}/status", ("SigIgn",)).get("SigIgn", 0)
                & _mask_bit(sig))


def blocks(pid: int, sig: int) -> bool:
    """Whether every thread of process ``pid`` blocks ``sig`` (``SigBlk``
    of each task: a signal sent to the process goes to any thread that
    does not block it); False where it cannot be read."""
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return False
    masks = [_status_masks(f"/proc/{pid}/task/{tid}/status", ("SigBlk",)) for tid in tasks]
    return bool(masks) and all(m.get("SigBlk", 0) & _mask_bit(sig) for m in masks)
