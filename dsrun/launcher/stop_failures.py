"""Ranks that failed of their own while a signal stopped the job.

A stop signal (a preemption, Slurm's time limit, ``scancel``, Ctrl-C) ends
the job as an interruption: its exit status is 128+N and ``--max_restarts``
does not start another attempt. Every rank exit that comes during that stop
is counted with it, but not every such exit was the signal's doing: a
rank's preemption save may raise (a full disk), the rank may crash (a
SIGSEGV in a library while it saves) or leave with a status of its own
(``os._exit(3)``). Whether the save it was making completed must not hang
on one streamed traceback among the ranks' output, nor on nothing at all
(a crash writes no record), so the supervisor names each such rank in a
line of its own (:func:`own_failure_lines`).

A rank's exit is the stop's doing - no line - when it exited 0, died of a
stop signal (SIGTERM, SIGINT, SIGHUP) or of the SIGKILL its agent sent at
the end of the grace (the report says those separately), exited 128+N for
a stop signal N (Python's status after a KeyboardInterrupt, or a handler
that exits so), or left through ``sys.exit`` or a KeyboardInterrupt (the
script chose how to end on the signal). Anything else failed of its own.

dsrun's last line after a signal (:func:`stopped_line`) says "every rank
was stopped" only when every agent confirmed its ranks' stop and no rank
failed of its own; otherwise it says which ranks it could not confirm, or
how many failed.
"""

from __future__ import annotations

import signal
from collections.abc import Sequence

from dsrun.launcher.report import (
    JobResult,
    RankFailure,
    SigKilled,
    ended_of,
    ranks_on_hosts,
    signal_name,
)

#: The signals that stop a job (supervisor.STOP_SIGNALS).
STOP_SIGNALS = frozenset({int(signal.SIGTERM), int(signal.SIGINT), int(signal.SIGHUP)})
#: Exceptions a rank leaves through by the script's own choice on a signal.
CHOSEN_EXITS = ("KeyboardInterrupt", "SystemExit")


def failed_of_its_own(failure: RankFailure, ours: frozenset[tuple[str, int]]) -> bool:
    """Whether a rank's exit during a stop was not the stop's doing (module
    docstring); ``ours``: (host, rank) of the ranks their agents SIGKILLed."""
    if failure.rank is None or (failure.code == 0 and failure.signal is None):
        return False
    if failure.signal == signal.SIGKILL and (failure.host, failure.rank) in ours:
        return False
    if ended_of(failure) in STOP_SIGNALS:
        return False
    return (failure.error or {}).get("exc_type") not in CHOSEN_EXITS


def own_failures(failures: Sequence[RankFailure],
                 sigkilled: Sequence[SigKilled] = ()) -> list[RankFailure]:
    """The ranks that failed of their own during the stop, by host and rank."""
    ours = frozenset((k.host, r) for k in sigkilled for r in k.ranks)
    return [f for f in sorted(failures, key=lambda f: (f.host, f.rank or 0))
            if f.during_stop and failed_of_its_own(f, ours)]


def own_failure_lines(failures: Sequence[RankFailure], signum: int,
                      sigkilled: Sequence[SigKilled] = ()) -> list[str]:
    """A line for each rank that failed of its own during the stop that
    ``signum`` began (:func:`failed_of_its_own`), then one that says what
    that means for the job; none when no rank did."""
    name = signal_name(signum)
    lines = []
    for f in own_failures(failures, sigkilled):
        said = f.summary() or str((f.error or {}).get("message") or "")
        if not said:  # a crash or os._exit: no record, no traceback
            what = "a crash" if f.signal is not None else "an exit"
            said = f"{what} of its own, not {name}'s doing"
        lines.append(f"rank {f.rank} on host {f.host} failed during the stop "
                     f"({f.cause()}): {said}")
    if lines:
        lines.append(f"{len(lines)} rank(s) failed of their own while {name} stopped the job "
                     f"(above: a crash, an error of their own, or a collective broken by the "
                     f"other ranks' stop): whatever they were doing on the signal (a save) may "
                     f"not have completed; the job still ends as stopped by {name}, without a "
                     f"restart")
    return lines


def stopped_line(result: JobResult) -> str:
    """dsrun's last word after a signal: only what it knows (module docstring)."""
    name = signal.Signals(result.interrupted or signal.SIGINT).name
    if result.starting:
        name += " while the job was starting"
    if result.unconfirmed:
        who = ranks_on_hosts((u.host, u.ranks) for u in result.unconfirmed)[0]
        if all(u.forced for u in result.unconfirmed):
            return f"stopped by {name}; {who} killed with SIGKILL by srun (see above)"
        return f"stopped by {name}; could not confirm the stop of {who} (their agents did " \
            f"not confirm it: see above)"
    killed = sum(len(k.ranks) for k in result.sigkilled)
    own = len(own_failures(result.failures, result.sigkilled))
    notes = [f"{killed} of them with SIGKILL"] if killed else []
    if own:
        notes.append(f"{own} of them failed of {'its' if own == 1 else 'their'} own during "
                     f"the stop: above")
    said = "every rank was stopped" if not own else "every rank ended"
    return f"stopped by {name}; {said}" + (f" ({'; '.join(notes)})" if notes else "")
