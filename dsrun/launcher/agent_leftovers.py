"""The node agent's one line about the processes of the job other than its
ranks that the teardown stopped: those still running after the ranks ended
(a background upload a rank left behind, a helper that ignored the Ctrl-C's
SIGINT) and those that needed SIGKILL. Without it they would die unnamed,
and a file the upload was writing would simply be missing.

The line names how many, which ranks they came from (their process group,
else ``RANK`` in their environment) and up to :data:`SHOWN` of them by pid
and a short command. Kept to the standard library: every agent imports it.
"""

from __future__ import annotations

from collections.abc import Iterable

from dsrun.launcher.procs import Described

#: Processes named by pid and command in the line; the rest are counted.
SHOWN = 3
#: Characters of a command line shown.
COMMAND_CHARS = 40


def _processes(n: int) -> str:
    return f"{n} process" if n == 1 else f"{n} processes"


def _short(command: str) -> str:
    words = command.split()  # also the newlines of a sh -c script, runs of blanks
    if words:  # the program's name, not its directory
        words[0] = words[0].rstrip("/").rsplit("/", 1)[-1] or words[0]
    command = " ".join(words)
    return command if len(command) <= COMMAND_CHARS else command[:COMMAND_CHARS - 3] + "..."


def _listed(found: list[Described]) -> str:
    shown = ", ".join(f"pid {d.proc.pid} ({_short(d.command)})" for d in found[:SHOWN])
    more = len(found) - SHOWN
    return shown + (f" and {more} more" if more > 0 else "")


def _whose(found: Iterable[Described], groups: dict[int, int], ranks: set[int]) -> str:
    """"rank 0", "ranks 0, 1", or "the ranks" when one of them cannot be told."""
    owners: set[int] = set()
    for d in found:
        rank = groups.get(d.group) if d.group is not None else None
        if rank is None and d.rank is not None and d.rank.isdigit() and int(d.rank) in ranks:
            rank = int(d.rank)
        if rank is None:
            return "the ranks"
        owners.add(rank)
    ordered = sorted(owners)
    if len(ordered) == 1:
        return f"rank {ordered[0]}"
    return "ranks " + ", ".join(str(r) for r in ordered)


def leftover_line(left: list[Described], killed: list[Described], job_ended: bool,
                  groups: dict[int, int]) -> str | None:
    """The line, or None when there is nothing to say.

    ``left``: still running after the ranks ended, stopped then;
    ``killed``: those that needed SIGKILL (some may be in ``left`` too);
    ``job_ended``: the ranks all succeeded (else the job was being stopped);
    ``groups``: each rank's process group -> its rank.
    """
    ranks = set(groups.values())
    left_pids = {d.proc for d in left}
    parts = []
    if left:
        when = "the job ended" if job_ended else "the ranks exited"
        also = sum(1 for d in killed if d.proc in left_pids)
        cut = "" if not also else " (with SIGKILL)" if len(left) == 1 else \
            " (all with SIGKILL)" if also == len(left) else f" ({also} of them with SIGKILL)"
        parts.append(f"stopped {_processes(len(left))} that {_whose(left, groups, ranks)} left "
                     f"running after {when}{cut}: {_listed(left)}")
    other = [d for d in killed if d.proc not in left_pids]
    if other:
        parts.append(f"{_processes(len(other))} started by {_whose(other, groups, ranks)} "
                     f"needed SIGKILL: {_listed(other)}")
    return "; ".join(parts) or None
