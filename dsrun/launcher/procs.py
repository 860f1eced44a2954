"""Finding and stopping every process of a job on this host.

A job's processes are (a) the members of each rank's process group - every
rank is a group leader - and (b) any process whose environment carries the
``DSRUN_AGENT_ID`` marker its node agent gave it, which catches descendants
that left the group (``setsid``, daemonising). The marker is per agent, not
per job, so that agents of one job whose hosts share a PID namespace never
stop each other's ranks. Stopping is SIGTERM, a deadline, SIGKILL, then a
re-scan until nothing is found, since a dying process may fork.

Only this job's processes are ever touched. A rank is known as a
:class:`Leader` - its pid *and* its start time - and its group is signalled
(or its members matched by group) only while the process with that pid is
still the one that was started: a pid, once its process is reaped, may be
given to someone else's process, which may lead a group of its own. The
node agent keeps each exited rank unreaped (a zombie holds its pid and its
group id) until the teardown is over; the guard, which cannot do that,
relies on the start-time check.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import psutil

JOB_MARKER = "DSRUN_AGENT_ID"


def _psutil():  # noqa: ANN202 - imported when first needed: agents start faster
    import psutil

    return psutil


@dataclass(frozen=True)
class Leader:
    """A process group leader this agent started: pid and start time."""

    pid: int
    started: float  # psutil's create_time(): the same for the process's whole life

    @classmethod
    def of(cls, pid: int) -> Leader | None:
        """The leader ``pid`` as it is now (None: already gone)."""
        ps = _psutil()
        try:
            return cls(pid, ps.Process(pid).create_time())
        except ps.Error:
            return None

    def ours(self) -> bool:
        """Whether ``pid`` still names the process that was started (also
        as an unreaped zombie, which still holds its group id)."""
        ps = _psutil()
        try:
            return ps.Process(self.pid).create_time() == self.started
        except ps.Error:
            return False

    def line(self) -> str:
        return f"{self.pid} {self.started!r}"

    @classmethod
    def parse(cls, line: str) -> Leader | None:
        parts = line.split()
        try:
            return cls(int(parts[0]), float(parts[1])) if len(parts) == 2 else None
        except ValueError:
            return None


def live_groups(leaders: Iterable[Leader]) -> list[int]:
    """Group ids of ``leaders`` that are still ours (see the module docstring)."""
    return [leader.pid for leader in leaders if leader.ours()]


def job_processes(leaders: Iterable[Leader], marker: str | None) -> list[psutil.Process]:
    """Live (non-zombie) processes of this job, excluding the caller."""
    ps = _psutil()
    groups = set(live_groups(leaders))
    me = os.getpid()
    found = []
    for proc in ps.process_iter():
        if proc.pid == me:
            continue
        try:
            if proc.status() == ps.STATUS_ZOMBIE:
                continue
            if os.getpgid(proc.pid) in groups or _has_marker(proc, marker):
                found.append(proc)
        except (ps.Error, OSError):
            continue
    return found


def _has_marker(proc: psutil.Process, marker: str | None) -> bool:
    if not marker:
        return False
    ps = _psutil()
    try:
        return proc.environ().get(JOB_MARKER) == marker
    except (ps.AccessDenied, ps.ZombieProcess, OSError):
        return False


def signal_groups(leaders: Iterable[Leader], sig: int) -> None:
    """``sig`` to the group of every leader that is still ours."""
    for pgid in live_groups(leaders):
        try:
            os.killpg(pgid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def signal_job(leaders: Iterable[Leader], marker: str | None, sig: int) -> None:
    """Send ``sig`` to each group and to every marked process of the job."""
    leaders = list(leaders)
    signal_groups(leaders, sig)
    _signal_procs(job_processes(leaders, marker), sig)


def _signal_procs(procs: Iterable[psutil.Process], sig: int) -> None:
    ps = _psutil()
    for proc in procs:
        try:
            proc.send_signal(sig)  # psutil refuses a pid reused since the scan
        except ps.Error:
            pass


def stop_job(leaders: Iterable[Leader], marker: str | None, grace: float, *,
             already_termed: bool = False, deadline: float | None = None) -> int:
    """Stop every process of the job; return how many needed SIGKILL.

    ``deadline`` (a ``time.monotonic()`` value) overrides ``grace`` when the
    caller already sent SIGTERM earlier and the grace period is running.
    """
    leaders = list(leaders)
    procs = job_processes(leaders, marker)
    if not procs:
        return 0
    if not already_termed:
        signal_groups(leaders, signal.SIGTERM)
        _signal_procs(procs, signal.SIGTERM)
    end = time.monotonic() + grace if deadline is None else deadline
    while time.monotonic() < end:
        procs = job_processes(leaders, marker)
        if not procs:
            return 0
        time.sleep(0.05)
    return kill_job(leaders, marker)


def kill_job(leaders: Iterable[Leader], marker: str | None, rounds: int = 20) -> int:
    """SIGKILL every process of the job until a scan finds none."""
    ps = _psutil()
    leaders = list(leaders)
    killed: set[int] = set()
    for _ in range(rounds):
        procs = job_processes(leaders, marker)
        if not procs:
            break
        signal_groups(leaders, signal.SIGKILL)
        _signal_procs(procs, signal.SIGKILL)
        killed.update(p.pid for p in procs)
        ps.wait_procs(procs, timeout=0.5)
    return len(killed)
