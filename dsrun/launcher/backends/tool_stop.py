"""Ending what a SIGKILLed launch tool (mpirun) leaves running on this host.

mpirun answers the end of its job, a rank's ``MPI_Abort``, an agent's
failure or a signal by its kill sequence (openmpi.py): SIGCONT, then it
sleeps ``odls_base_sigkill_timeout`` seconds (``--kill_grace`` + 1) before
its SIGTERM and as long again before its SIGKILL, and it cannot exit before
the sequence is over. dsrun does not wait that out: it SIGKILLs mpirun
(a SIGTERM would only start the same sleep), and then nothing kills the
agents mpirun had started here - an agent that has not connected back yet
has no link to lose and keeps dialling for ``DSRUN_LAUNCHER_TIMEOUT``. So
dsrun SIGKILLs them itself: every process of this user that carries the
attempt's callback secret (``DSRUN_LAUNCHER_SECRET``, protocol.py) in the
environment it started with. Only the agents do: they remove it from their
ranks' environment (envlayers.py), and the secret is random per attempt,
so no other job's process matches. An agent's death takes its ranks with it
(parent-death signal, and its guard). Agents on other hosts are their
orted's: it loses its lifeline to mpirun and ends them.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time

from dsrun.launcher import procs, protocol

#: Seconds between looks at the tool and its agents while waiting.
POLL = 0.1
#: Rounds of "find, SIGKILL" (an agent found mid-start is found again).
KILL_ROUNDS = 5


def agents_left(secret: str, tool: int = 0) -> list[procs.Proc]:
    """The processes on this host (this user's; not this one, nor the
    ``tool`` itself, which has the secret too) started with ``secret`` as
    their callback secret (Linux; elsewhere none are found)."""
    if not os.path.isdir("/proc/self"):
        return []
    want = f"{protocol.SECRET_VAR}={secret}".encode()
    found: list[procs.Proc] = []
    me, uid = os.getpid(), os.getuid()
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) in (me, tool):
            continue
        try:
            if os.stat(f"/proc/{name}").st_uid != uid:
                continue
            with open(f"/proc/{name}/environ", "rb") as f:
                entries = f.read().split(b"\0")
        except OSError:
            continue
        if want in entries:
            proc = procs.Proc.of(int(name))
            if proc is not None:
                found.append(proc)
    return found


def kill_agents(secret: str) -> int:
    """SIGKILL every process :func:`agents_left` finds, until none is left
    (zombies aside); how many were signalled."""
    killed = 0
    for _ in range(KILL_ROUNDS):
        live = [p for p in agents_left(secret) if not _zombie(p.pid)]
        if not live:
            break
        for proc in live:
            procs.send(proc, signal.SIGKILL)
        killed += len(live)
        time.sleep(0.05)
    return killed


def wait_exit(proc: subprocess.Popen[bytes], seconds: float,
              secret: str | None = None) -> bool:
    """Wait up to ``seconds`` for ``proc`` to exit (True if it did). With
    ``secret``: stop waiting (False) as soon as no agent carrying it is left
    on this host either - mpirun then only sleeps out its kill sequence."""
    if secret is None:
        try:
            proc.wait(seconds)
            return True
        except subprocess.TimeoutExpired:
            return False
    end = time.monotonic() + seconds
    while True:
        if proc.poll() is not None:
            return True
        left = end - time.monotonic()
        if left <= 0 or not [p for p in agents_left(secret, proc.pid) if not _zombie(p.pid)]:
            return proc.poll() is not None
        try:
            proc.wait(min(POLL * 5, left))
            return True
        except subprocess.TimeoutExpired:
            continue


def _zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] == b"Z"
    except (OSError, IndexError):
        return False
