"""Which failure is the root cause of a job's end, and when the end was an
interruption (a stop signal) rather than a failure (report.py prints it).

"Earliest" never compares two hosts' wall clocks, which may be skewed: a
failure is ordered by :attr:`RankFailure.seen`, the launcher's monotonic
clock when it read the agent's report, less the delay the agent measured
on its own monotonic clock between the failure and sending the report
(``age``). Only the launcher's host's clock is used.

A rank whose collective failed because a peer died ("Connection reset by
peer" from gloo, an NCCL remote error, dsrun's "could not exchange" between
ranks) often looks earlier than the death itself: its record is stamped
when its error was raised, the death only when its agent woke up to it.
Such a *peer-loss* failure yields the root cause to any other failure up to
:data:`PEER_WINDOW` seconds after it (a rank that died without a traceback,
by a signal, or with an error of its own), and is counted as a consequence.

A rank that ends with status 0 while others still run is no failure by
itself (``JobResult.early_exits`` keeps them), but it is the likely cause
when, within :data:`EARLY_EXIT_WINDOW` seconds after it, the job fails only
by losing a peer (the others still expected it in a collective) or by a
stop signal to node agents: mpirun stops the job when one of its ranks ends
without ``MPI_Finalize`` (orted signals the agents). Only that close: a
"connection reset by peer" an hour later may be any socket of the script's
own (an upload), not the rank that left. An early exit further back is
only mentioned next to a peer loss, never blamed, unless the rank's error
names it (:data:`EXITED_PEER`: a checkpoint call that was waiting for that
rank).

A stop signal sent to every process of the job (Slurm's time limit, a
preemption, ``scancel``) reaches the launcher, the node agents and the
ranks in any order. A rank without a handler of its own dies of it at once,
often before its agent's handler has run: such a rank is counted with the
signal (:func:`interruption`), not blamed, when dsrun itself or any node
agent got that same signal within :data:`JOB_WIDE_WINDOW` of its end.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from dsrun.launcher.report import RankFailure

#: Seconds by which a peer-loss failure may look earlier than the failure
#: that caused it (the agents' wake-ups on a loaded host, a network hop).
PEER_WINDOW = 5.0
#: Seconds after a rank's early exit with status 0 within which a stop
#: signal to the node agents, or another rank's peer loss, is taken as a
#: consequence of it (mpirun stops a job at once when a rank ends without
#: MPI_Finalize; a collective waiting on the rank fails at once).
EARLY_EXIT_WINDOW = 5.0
#: Seconds within which a rank that ended of signal N and dsrun's or a node
#: agent's own signal N are taken for one signal sent to every process of
#: the job (Slurm's time limit, preemption or scancel reach the launcher,
#: the agents and the ranks within milliseconds, in any order; a node that
#: gets it later is the rest). agent_exits.JOB_WIDE is the same.
JOB_WIDE_WINDOW = 2.0
#: How a rank's error names a peer whose exit it saw (a checkpoint call
#: waiting for it: runtime/exitmark.py): that exit is the cause, however
#: long before it came (no EARLY_EXIT_WINDOW).
EXITED_PEER = re.compile(r"\brank (\d+) exited \(status ")


def order(failure: RankFailure) -> tuple[int, float]:
    """The key that orders failures by when they happened (module docstring)."""
    # Failures the launcher stamped come first in their own order; a failure
    # without a stamp (built by hand, an old agent) falls back to its wall time.
    return (0, failure.seen) if failure.seen is not None else (1, failure.time)


def root_cause(failures: Sequence[RankFailure],
               early_exits: Sequence[RankFailure] = ()) -> RankFailure | None:
    """The earliest failure that was not a consequence of stopping the job,
    nor of a peer's failure within PEER_WINDOW after it; or the early exit
    with status 0 that explains it (module docstring)."""
    if not failures:
        return None
    genuine = [f for f in failures if not f.during_stop] or list(failures)
    first = min(genuine, key=order)
    if first.peer_loss:
        causes = [f for f in genuine if not f.peer_loss and within(first, f, PEER_WINDOW)]
        first = min(causes, key=order) if causes else first
    return _early_exit_cause(first, early_exits) or first


def _early_exit_cause(first: RankFailure,
                      early_exits: Sequence[RankFailure]) -> RankFailure | None:
    """The earliest early exit that explains ``first``, or None: one at most
    EARLY_EXIT_WINDOW before a peer loss or a stop signal to a node agent
    (for a peer loss also up to PEER_WINDOW after it: the loss may be
    stamped first)."""
    if not (first.peer_loss or first.signalled):
        return None
    named = [e for e in early_exits if e.rank in exited_peers(first)]
    if named:  # its error names them (EXITED_PEER)
        return min(named, key=order)
    causes = [e for e in early_exits
              if (order(e) <= order(first) and within(e, first, EARLY_EXIT_WINDOW))
              or (first.peer_loss and order(e) > order(first)
                  and within(first, e, PEER_WINDOW))]
    return min(causes, key=order) if causes else None


def exited_peers(failure: RankFailure) -> set[int]:
    """The ranks whose exit ``failure``'s error names (EXITED_PEER)."""
    return {int(r) for r in EXITED_PEER.findall(str((failure.error or {}).get("message") or ""))}


def within(first: RankFailure, later: RankFailure, seconds: float) -> bool:
    """``later`` happened at most ``seconds`` after ``first`` (same clock only:
    a stamped and an unstamped failure cannot be compared, so they count)."""
    a, b = order(first), order(later)
    return a[0] != b[0] or b[1] - a[1] <= seconds


def interruption(failures: Sequence[RankFailure], early_exits: Sequence[RankFailure],
                 own: int | None, own_seen: float | None) -> int | None:
    """The signal that stopped the job when no failure did, else None.

    That is a stop signal to a node agent, when it is the root cause (no
    early exit explains it: mpirun's orted signals the agents after one),
    or a signal N that a rank ended of - killed by it, or exiting 128+N as
    Python does after a KeyboardInterrupt or a handler that exits so - when
    that rank is the root cause and dsrun itself (``own``, got at
    ``own_seen`` on the launcher's monotonic clock) or any node agent got
    the same N within :data:`JOB_WIDE_WINDOW` of its end: one signal sent
    to every process of the job, whichever process it reached first."""
    cause = root_cause(failures, early_exits)
    if cause is None or cause.early_exit:
        return None
    if cause.signalled:
        return cause.signal
    sig = ended_of(cause)
    if sig is None or cause.seen is None:
        return None
    heard = [(f.signal, f.seen) for f in failures if f.signalled]
    if own is not None:
        heard.append((own, own_seen))
    return sig if any(s == sig and seen is not None and abs(seen - cause.seen) <= JOB_WIDE_WINDOW
                      for s, seen in heard) else None


def ended_of(failure: RankFailure) -> int | None:
    """The signal a rank ended of: killed by it, or exiting 128+N."""
    if failure.rank is None:
        return None
    if failure.signal is not None:
        return failure.signal
    code = failure.code
    return code - 128 if code is not None and 128 < code < 128 + 65 else None


def signalled_agent(failures: Sequence[RankFailure], signum: int) -> RankFailure | None:
    """The first node agent that got ``signum`` itself (its ``signal`` event)."""
    found = [f for f in failures if f.signalled and f.signal == signum]
    return min(found, key=order) if found else None

