"""What the node agent reports of a rank's exit (the ``exit`` event of
protocol.py): its code or signal, how long ago it failed, and whether it
failed on its own or of the agent's stop.

Invariants: the earliest evidence of a failure wins (the rank's own error
record, stamped when the error was raised, else the moment its exit was
seen), and a rank already failing on its own when the stop's signal caught
it in its exit path is reported with its own exit code. A rank that died
of the very signal the agent got itself, at most :data:`JOB_WIDE` seconds
before it, is reported as part of the stop (``during_stop``): one signal
sent to every process of the job (Slurm's time limit, a preemption,
``scancel``) kills a rank without a handler before the agent's own handler
runs, and that rank did not fail on its own. A record is the
rank's only if the rank's own process wrote it (its ``pid``): a child the
script forked inherits the record's path, and its error is not the rank's.
Kept to the standard library: every agent imports it.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

from dsrun.launcher.agent_os import STOP_SIGNALS, wait_status
from dsrun.launcher.agent_output import Rank

#: Seconds before the agent's own stop signal within which a rank that
#: ended of that signal ended of the same delivery (report.JOB_WIDE_WINDOW).
JOB_WIDE = 2.0


def stop_signal_of(status: int) -> int | None:
    """The stop signal (agent_os.STOP_SIGNALS) a rank with exit status
    ``status`` (as Popen.returncode) ended of - killed by it, or exiting
    128+N as Python does after a KeyboardInterrupt - or None."""
    for sig in STOP_SIGNALS:
        if status in (-sig, 128 + sig):
            return int(sig)
    return None


def poll_status(pid: int) -> int | None:
    """The exit status (as Popen.returncode) of the child ``pid`` if it has
    exited, leaving it unreaped (its pid and group id stay held); else None."""
    try:
        info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT | os.WNOHANG)
    except ChildProcessError:
        return None
    return None if info is None else wait_status(info)


def record_exit(lock: threading.Lock, rank: Rank, status: int, mono: float) -> None:
    """Record a rank's exit, once (its wait thread, or :func:`poll_exits`)."""
    with lock:
        if rank.status is None:
            rank.exit_mono = mono
            rank.status = status


def poll_exits(lock: threading.Lock, ranks: list[Rank]) -> None:
    """Note the ranks already dead whose wait thread has not woken yet.

    Before a stop begins: a rank that died on its own (``os._exit``, a
    signal) wakes its peers with a closed connection before its wait
    thread runs, so the peer's failure can start the stop first, and
    the dead rank would look like one the stop ended."""
    for rank in ranks:
        status = poll_status(rank.popen.pid) if rank.status is None else None
        if status is not None:
            record_exit(lock, rank, status, time.monotonic())


def own_error(rank: Rank, error: dict[str, Any] | None) -> dict[str, Any] | None:
    """``error`` if the rank's own process wrote it, else None: a record of
    a forked child (its pid is not the rank's) says nothing of how the rank
    ended, and its time would make the rank look like the first to fail.
    A record without a pid (an older runtime) is taken as the rank's."""
    if error is None or "pid" not in error:
        return error
    try:
        return error if int(error["pid"]) == rank.popen.pid else None
    except (TypeError, ValueError):
        return None


def exit_event(rank: Rank, error: dict[str, Any] | None, stopping: bool,
               stop_mono: float, signalled: tuple[int, float] | None = None
               ) -> dict[str, Any]:
    """The ``exit`` event of ``rank`` (its status known), with its error
    record ``error``; ``stop_mono``: time.monotonic() when the agent began
    stopping the job (``stopping``); ``signalled``: the agent's own stop
    signal and when it came (time.monotonic()), if it got one; a record the
    rank did not write itself is left out (:func:`own_error`)."""
    error = own_error(rank, error)
    code = rank.status
    assert code is not None
    now_mono, now_wall = time.monotonic(), time.time()
    # The rank's own record is stamped when the error was raised, before
    # the process finished exiting: the earliest evidence. Its wall time
    # is this host's clock, as is the agent's, so the difference holds.
    age = now_mono - rank.exit_mono
    if error is not None and "time" in error:
        age = max(age, now_wall - float(error["time"]))
    when_mono = now_mono - age
    during_stop = stopping and when_mono >= stop_mono
    if signalled is not None and stop_signal_of(code) == signalled[0] \
            and when_mono >= signalled[1] - JOB_WIDE:
        during_stop = True  # the agent's own signal killed it too (module docstring)
    if code < 0 and error is not None and when_mono < stop_mono:
        # It was already failing on its own (the record says how) when
        # our SIGTERM caught it in its exit path: report its own code.
        code = int(error.get("exit_code", 1))
    return {"ev": "exit", "rank": rank.rank,
            "code": code if code >= 0 else None,
            "signal": -code if code < 0 else None,
            "time": now_wall - age, "age": round(age, 6), "during_stop": during_stop,
            "error": error, "tail": rank.tail.lines()}
