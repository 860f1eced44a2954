"""Finding and stopping every process of a job on this host.

A job's processes are (a) the members of each rank's process group - every
rank is a group leader - and (b) any process whose environment carries the
``DSRUN_AGENT_ID`` marker its node agent gave it, which catches descendants
that left the group (``setsid``, daemonising). The marker is per agent, not
per job, so that agents of one job whose hosts share a PID namespace never
stop each other's ranks. Stopping is SIGTERM, a deadline, SIGKILL,
then a re-scan until nothing is found, since a dying process may fork.
Only this job's processes are ever touched.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterable

import psutil

JOB_MARKER = "DSRUN_AGENT_ID"


def job_processes(pgids: Iterable[int], job_id: str | None) -> list[psutil.Process]:
    """Live (non-zombie) processes of this job, excluding the caller."""
    groups = set(pgids)
    me = os.getpid()
    found = []
    for proc in psutil.process_iter():
        if proc.pid == me:
            continue
        try:
            if proc.status() == psutil.STATUS_ZOMBIE:
                continue
            if os.getpgid(proc.pid) in groups or _has_marker(proc, job_id):
                found.append(proc)
        except (psutil.Error, OSError):
            continue
    return found


def _has_marker(proc: psutil.Process, job_id: str | None) -> bool:
    if not job_id:
        return False
    try:
        return proc.environ().get(JOB_MARKER) == job_id
    except (psutil.AccessDenied, psutil.ZombieProcess, OSError):
        return False


def signal_groups(pgids: Iterable[int], sig: int) -> None:
    for pgid in pgids:
        try:
            os.killpg(pgid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def signal_job(pgids: Iterable[int], job_id: str | None, sig: int) -> None:
    """Send ``sig`` to each group and to every marked process of the job."""
    groups = list(pgids)
    signal_groups(groups, sig)
    _signal_procs(job_processes(groups, job_id), sig)


def _signal_procs(procs: Iterable[psutil.Process], sig: int) -> None:
    for proc in procs:
        try:
            proc.send_signal(sig)
        except psutil.Error:
            pass


def stop_job(pgids: Iterable[int], job_id: str | None, grace: float, *,
             already_termed: bool = False, deadline: float | None = None) -> int:
    """Stop every process of the job; return how many needed SIGKILL.

    ``deadline`` (a ``time.monotonic()`` value) overrides ``grace`` when the
    caller already sent SIGTERM earlier and the grace period is running.
    """
    groups = list(pgids)
    procs = job_processes(groups, job_id)
    if not procs:
        return 0
    if not already_termed:
        signal_groups(groups, signal.SIGTERM)
        _signal_procs(procs, signal.SIGTERM)
    end = time.monotonic() + grace if deadline is None else deadline
    while time.monotonic() < end:
        procs = job_processes(groups, job_id)
        if not procs:
            return 0
        time.sleep(0.05)
    return kill_job(groups, job_id)


def kill_job(pgids: Iterable[int], job_id: str | None, rounds: int = 20) -> int:
    """SIGKILL every process of the job until a scan finds none."""
    groups = list(pgids)
    killed: set[int] = set()
    for _ in range(rounds):
        procs = job_processes(groups, job_id)
        if not procs:
            break
        signal_groups(groups, signal.SIGKILL)
        _signal_procs(procs, signal.SIGKILL)
        killed.update(p.pid for p in procs)
        psutil.wait_procs(procs, timeout=0.5)
    return len(killed)
