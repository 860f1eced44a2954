"""What the supervisor watches besides exits: stragglers and stack requests.

Pure bookkeeping over the launcher's monotonic clock; the supervisor feeds
it events and prints what it returns.

- :class:`Stragglers`: once some ranks have exited and others run on, a
  line at growing intervals (first after ``DSRUN_STRAGGLER_INTERVAL``
  seconds, default 30, then doubling up to an hour) naming the ranks still
  running, their hosts and for how long - a hung rank is never silent.
- :class:`StackCollection`: one stack request to every agent (``dsrun
  stack``, or a ``--timeout``): which agents have yet to answer, the lines
  collected so far, and a deadline.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

DEFAULT_STRAGGLER_INTERVAL = 30.0
MAX_STRAGGLER_INTERVAL = 3600.0
#: Ranks named in one straggler line before "and N more".
SHOWN = 8


@dataclass
class RankState:
    host: str
    pid: int | None
    started: float  # launcher monotonic
    ended: float | None = None


def duration(seconds: float) -> str:
    seconds = int(seconds)
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


@dataclass
class Stragglers:
    """When to say which ranks are still running (see the module docstring)."""

    first_interval: float = DEFAULT_STRAGGLER_INTERVAL
    hint: str = ""  # appended to each line (how to see the stacks)
    first_exit: float | None = None
    next_at: float | None = None
    interval: float = 0.0

    def exited(self, now: float) -> None:
        if self.first_exit is None:
            self.first_exit = now
            self.interval = self.first_interval
            self.next_at = now + self.interval

    def line(self, now: float, ranks: dict[int, RankState], paused: bool = False) -> str | None:
        """The line due at ``now``, if any (then the next one is scheduled);
        ``paused``: the ranks' output is held for a slow reader of dsrun's
        stdout, so the ranks still running may only be blocked in their writes."""
        if self.next_at is None or now < self.next_at or self.first_exit is None:
            return None
        running = sorted(r for r, s in ranks.items() if s.ended is None)
        if not running:
            return None
        self.interval = min(self.interval * 2, MAX_STRAGGLER_INTERVAL)
        self.next_at = now + self.interval
        finished = len(ranks) - len(running)
        shown = ", ".join(f"rank {r} on {ranks[r].host} (running "
                          f"{duration(now - ranks[r].started)})" for r in running[:SHOWN])
        more = f" and {len(running) - SHOWN} more" if len(running) > SHOWN else ""
        note = " (output paused: dsrun's stdout reader is slow)" if paused else ""
        return (f"{finished} of {len(ranks)} rank(s) finished {duration(now - self.first_exit)}"
                f" ago; still running: {shown}{more}{self.hint}{note}")


def stack_lines(host: str, rank: int, text: str | None, stopped: bool = False) -> list[str]:
    """One agent's answer for one rank, as ``[host:rank] ...`` lines
    (``stopped``: the rank is stopped by a signal and cannot answer)."""
    prefix = f"[{host}:{rank}]"
    if stopped:
        return [f"{prefix} (no stack: the rank is stopped (SIGSTOP), not running; "
                f"SIGCONT resumes it)"]
    if text is None:
        return [f"{prefix} (no Python stack: the rank runs without dsrun's runtime "
                f"(--no_python), or has not started it yet)"]
    lines = [ln for ln in text.rstrip("\n").splitlines()]
    if not lines:
        return [f"{prefix} (no answer: the rank did not write its stack in time)"]
    return [f"{prefix} {ln}" for ln in lines]


@dataclass
class StackCollection:
    """One stack request in flight."""

    req: int
    pending: set[int]  # channels that have not sent stack_end
    deadline: float
    write: Callable[[str], object]
    close: Callable[[], None] | None = None  # the requester's end, once complete
    lines: list[str] = field(default_factory=list)

    def answer(self, host: str, rank: int, text: str | None, stopped: bool = False) -> None:
        for line in stack_lines(host, rank, text, stopped):
            self.lines.append(line)
            self.write(line)

    def ended(self, channels: Iterable[int]) -> None:
        self.pending.difference_update(channels)

    def complete(self, now: float) -> bool:
        return not self.pending or now >= self.deadline
