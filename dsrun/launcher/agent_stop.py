"""A node agent's hold on the job's processes on its host: finding those
that left the ranks' groups, and stopping them all (procs.py does the
finding and signalling; this is the agent's state around it).

Stopping is the first signal to every process of the job - SIGTERM, or for
the launcher's Ctrl-C SIGINT to the ranks' groups, as a terminal gives it to
its foreground group (SIGTERM to a rank that ignores SIGINT), and SIGTERM to
the job's processes outside them - then
SIGCONT (a stopped process acts on it only once continued). After a SIGINT,
once every rank has exited, what is still running gets SIGTERM: a helper
started with ``&`` ignores SIGINT (as every background job of a shell
without job control does), and would otherwise sit out the whole grace.
SIGKILL goes to the ranks still running once ``kill_grace`` has passed (at
once when hurried: a kill command, a second signal), and a final sweep
leaves nothing. The ranks that died
of that SIGKILL are named in the ``done`` event (``sigkilled``), so the
launcher's report can say whose handlers - a save on ``KeyboardInterrupt``,
a ``finally`` - were cut off; the job's other processes that the teardown
stopped after the ranks ended, or with SIGKILL, are named in one line of
the agent's (agent_leftovers.py). Kept to the standard library: every
agent imports it.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable
from typing import Any

from dsrun.launcher import procs
from dsrun.launcher.agent_leftovers import leftover_line
from dsrun.launcher.agent_output import Rank
from dsrun.launcher.guard import Guard

#: Seconds the teardown lets the job's other processes end by themselves
#: once the ranks have (a worker still acting on the Ctrl-C, a child a rank
#: was reaping) before it stops and names those left.
SETTLE = 0.2
#: The longest grace of a stop that a failure began (a rank's, the host's,
#: another host's: the launcher's ``stop`` says ``failure``): the ranks left
#: are usually blocked in a collective with the one that died, where no
#: handler runs and no save can complete, so --kill_grace would only delay
#: the report and every --max_restarts restart. A stop that a signal began
#: (Ctrl-C, SIGTERM, a scheduler's time limit) or --timeout keeps the whole
#: --kill_grace, and a signal to the agent during a failure's stop extends
#: it to that (the same signal reached the ranks, which may be saving).
FAILURE_GRACE = 5.0


def leaders(ranks: list[Rank]) -> list[procs.Leader]:
    """The process-group leaders of the ranks started."""
    return [r.leader for r in ranks if r.leader is not None]


class JobProcesses:
    """This host's processes of the job (see the module docstring).

    ``spare``: None, or the agent is its descendants' subreaper and every
    process below it but these (its guard) is the job's (procs.job_processes).
    """

    def __init__(self, marker: str, since: float, grace: float, guard: Guard | None,
                 spare: frozenset[int] | None) -> None:
        self.marker = marker
        self.since = since  # the agent's start: every job process started later
        self.grace = grace
        self.guard = guard
        self.spare = spare
        self.escaped: set[procs.Proc] = set()  # told to the guard (record_escaped)
        self.stopping = False
        self.first = signal.SIGTERM  # what the stop sent first
        self.stop_mono = float("inf")  # time.monotonic() when stopping began
        self.deadline = 0.0
        self.hard_killed = False
        self.short = False  # the grace is a failure's (FAILURE_GRACE)
        self.rushed = False  # hurry() was called: no grace to extend
        self.at_once = False  # SIGKILL came before the grace was over (hurried)
        self.sigkilled: set[int] = set()  # ranks still running when SIGKILL was sent
        # The job's other processes the teardown stopped after the ranks
        # ended, and those it SIGKILLed (read while they lived): the line.
        self.left: list[procs.Described] = []
        self.killed_others: dict[procs.Proc, procs.Described] = {}
        self.rank_pids: set[int] = set()
        self.line: str | None = None

    # -- while the job runs ---------------------------------------------------
    def own_children(self, ranks: list[Rank]) -> set[int]:
        """Children whose status is not the orphan reaper's to take."""
        kept = {rank.popen.pid for rank in ranks}
        return kept | ({self.guard.pid} if self.guard is not None else set())

    def check_children(self, ranks: list[Rank]) -> str | None:
        """Reap adopted orphans (subreaper) and tell the guard of escaped job
        processes; how the guard died, if it did (None: it lives)."""
        if self.spare is not None:
            procs.reap_adopted(self.own_children(ranks))
            if self.guard is not None and not self.stopping:
                self._record_escaped(ranks)
        how = self.guard.died() if self.guard is not None else None
        if how is not None:
            self.spare = frozenset()  # reaped: its pid may name a job process now
        return how

    def _record_escaped(self, ranks: list[Rank]) -> None:
        """Job processes outside every rank's group (they left it: setsid,
        daemonisers) go to the guard, which is no ancestor of theirs: if
        the agent is SIGKILLed they reparent to init, and those that also
        dropped the marker could not be found by it otherwise."""
        assert self.guard is not None and self.spare is not None
        for proc in procs.outside_groups([p.pid for p in leaders(ranks)], self.spare):
            if proc not in self.escaped:
                self.escaped.add(proc)
                self.guard.escaped(proc)

    # -- stopping -------------------------------------------------------------
    def begin(self, ranks: list[Rank], sig: signal.Signals, failure: bool = False) -> None:
        """The first signal to every rank's group and every other process of
        the job (once: SIGTERM to those outside the groups after a SIGINT);
        SIGKILL follows ``grace`` seconds later, at most FAILURE_GRACE for a
        stop a ``failure`` began. A stop that is no failure's, asked for
        during a failure's, gets the whole grace (from the stop's start)."""
        if self.stopping:
            if not failure and self.short and not (self.rushed or self.hard_killed):
                self.short = False
                self.deadline = max(self.deadline, self.stop_mono + self.grace)
            return
        self.stopping = True
        self.first = sig
        self.stop_mono = time.monotonic()
        self.short = failure and self.grace > FAILURE_GRACE
        self.deadline = self.stop_mono + (FAILURE_GRACE if self.short else self.grace)
        # A rank that ignores SIGINT (signal.SIG_IGN: a script that leaves
        # Ctrl-C to rank 0, a SIGTERM-only preemption handler) gets SIGTERM,
        # as the job's other processes do: it would only sit out the grace.
        deaf = [r for r in leaders(ranks) if procs.ignores(r.pid, sig)] \
            if sig == signal.SIGINT else []
        procs.signal_job(leaders(ranks), self.marker, sig, self.since, self.spare,
                         others=signal.SIGTERM, deaf=deaf)
        # A stopped process (SIGSTOP, a debugger let go) acts on the signal
        # only once continued: it gets its grace too, as systemd does it.
        procs.signal_job(leaders(ranks), self.marker, signal.SIGCONT, self.since, self.spare)

    def hurry(self) -> None:
        """Nobody waits for the grace any more: SIGKILL at the next check."""
        now = time.monotonic()
        self.rushed = True
        if not self.hard_killed and self.deadline > now:
            self.at_once = True
        self.deadline = min(self.deadline, now)

    def kill_overdue(self, ranks: list[Rank]) -> None:
        """SIGKILL the groups of the ranks still running once the deadline
        has passed (their exits are reported as they come)."""
        if not self.stopping or self.hard_killed or time.monotonic() < self.deadline:
            return
        running = [r for r in ranks if r.status is None]
        self.sigkilled.update(r.rank for r in running)
        self.rank_pids = {r.popen.pid for r in ranks}
        for proc in procs.job_processes(leaders(running), None, self.since):
            self._note_kill(proc)  # the ranks' helpers die with them: named
        procs.signal_groups(leaders(running), signal.SIGKILL)
        self.hard_killed = True

    def finish(self, ranks: list[Rank], hurried: Callable[[], bool]) -> dict[str, Any]:
        """Make sure nothing of the job is left on this host, and reap the
        ranks (their pids were the agent's until here). The ``done`` event's
        facts: processes SIGKILLed by this sweep (``killed``), and the ranks
        that died of a SIGKILL of ours (``sigkilled``), after which signal
        (``after``) and whether before the grace was over (``at_once``)."""
        running = {r.rank for r in ranks if r.status is None}
        self.rank_pids = {r.popen.pid for r in ranks}
        job_ended = not self.stopping
        # The ranks have ended by themselves (succeeded), or acted on the
        # SIGINT: what is still running now the teardown stops (and names).
        after_ranks = not running and not self.hard_killed and not hurried() and \
            (job_ended or self.first != signal.SIGTERM)
        self.left = [procs.describe(p) for p in self._still_running(ranks)] \
            if after_ranks else []
        if self.left and job_ended:
            # Leftovers of a job that ended by itself: stopped as a stop does
            # it, SIGTERM then SIGCONT (a stopped one would sit out the grace).
            self.begin(ranks, signal.SIGTERM)
        elif self.left:  # after a SIGINT: they may ignore it (``&`` helpers)
            for sig in (signal.SIGTERM, signal.SIGCONT):
                procs.signal_job(leaders(ranks), self.marker, sig, self.since, self.spare)
        killed = procs.stop_job(leaders(ranks), self.marker, self.grace,
                                already_termed=self.stopping,
                                deadline=self.deadline if self.stopping else None,
                                since=self.since, hurry=hurried, spare=self.spare,
                                before_kill=self._note_kill)
        for rank in ranks:
            if rank.status is None:  # only after a second signal
                rank.popen.kill()
            rank.popen.wait()
        # Ours only: a rank still running when SIGKILL went out, and dead of it
        # (not one that was already exiting, nor one the OOM killer took before).
        cut = sorted(r.rank for r in ranks if r.rank in self.sigkilled | running
                     and r.popen.returncode == -signal.SIGKILL)
        if self.spare is not None:
            procs.reap_adopted(self.own_children(ranks))
        self.line = leftover_line(self.left, list(self.killed_others.values()), job_ended,
                                  {r.popen.pid: r.rank for r in ranks})
        return {"killed": killed, "sigkilled": cut, "after": self.first.name,
                "at_once": self.at_once or (bool(cut) and hurried()),
                "short": self.short}

    def _still_running(self, ranks: list[Rank]) -> list[procs.Proc]:
        """The job's processes other than the ranks still running once
        SETTLE has passed (or at once, when none is)."""
        end = time.monotonic() + SETTLE
        while True:
            found = [p for p in procs.job_processes(leaders(ranks), self.marker, self.since,
                                                    self.spare) if p.pid not in self.rank_pids]
            if not found or time.monotonic() >= end:
                return found
            time.sleep(0.05)

    def _note_kill(self, proc: procs.Proc) -> None:
        """``proc`` is about to be SIGKILLed: remember it, if it is no rank."""
        if proc.pid not in self.rank_pids and proc not in self.killed_others:
            known = next((d for d in self.left if d.proc == proc), None)
            self.killed_others[proc] = known or procs.describe(proc)
