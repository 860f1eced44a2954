"""What the supervisor tells at a job's end about stops no agent confirmed.

An agent confirms its ranks' stop with ``done``. One that never does - given
up on (lost, silent past the stop's deadline), or whose connection ended
first (killed by mpirun or srun ending a stop, killed by hand, its link
dropped) - leaves the ranks it had not reported the exit of unconfirmed:
what they did on the signal (a save) may not have completed, and dsrun
must not say "every rank was stopped" (stop_failures.stopped_line).

srun, signalled itself (SIGTERM, SIGHUP, SIGQUIT), SIGKILLs every task of
its step at once and says "forcing job termination"
(backends/connect.ToolOutput.forced): the agents' connections then end
without a word from them.
"""

from __future__ import annotations

from collections.abc import Mapping, Set

from dsrun.launcher.backends.base import JobHandle
from dsrun.launcher.report import Unconfirmed


def unconfirmed_agents(hosts: list[str], given_up: Set[int],
                       unreported: Mapping[int, Set[int]],
                       ended: Mapping[int, tuple[tuple[int, ...], bool]],
                       interrupted: bool, forced: str | None) -> tuple[Unconfirmed, ...]:
    """The agents (by index) that never confirmed their ranks' stop.

    ``given_up``: dropped by dsrun before their ``done``; ``unreported``:
    each agent's started ranks whose exit it did not report; ``ended``:
    agents whose connection ended without ``done``, with those ranks and
    whether the job was stopping then (one that ended before a stop is a
    failure of its own, named as such, unless the job's end is an
    interruption: srun's SIGKILL comes before any stop); ``forced``:
    srun's line, if it killed its step."""
    found = {i: Unconfirmed(hosts[i], tuple(sorted(unreported.get(i, ()))))
             for i in given_up}
    for i, (ranks, stopping) in ended.items():
        if i not in found and (stopping or interrupted):
            found[i] = Unconfirmed(hosts[i], ranks, ended=True, forced=forced is not None)
    return tuple(found[i] for i in sorted(found))


def forced_line(handle: JobHandle) -> str | None:
    """srun's "forcing job termination" line, once its output had it
    (backends/connect.ToolOutput.forced; None for other backends)."""
    output = getattr(getattr(handle, "tool", None), "output", None)
    forced = getattr(output, "forced", None)
    return forced if isinstance(forced, str) else None
