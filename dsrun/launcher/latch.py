"""The launcher's signal handlers while a job runs (installed by
jobsignals.take_signals, read by the supervisor's loop).

:class:`SignalLatch` takes the signals that stop a job (SIGINT, SIGTERM,
SIGHUP); :class:`Forwards` takes SIGUSR1 and SIGUSR2, which never stop it:
the supervisor has every agent pass them on to its ranks' process groups
(the requeue pattern of Slurm batch scripts, submitit, Lightning: ``kill
-USR1 $LAUNCHER_PID``), as torchrun's ``--signals_to_handle`` does for the
signals listed there. Neither raises outside a job's start, so no signal
escapes from the middle of stopping the job or of a message to an agent.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable

#: Seconds within which one more copy of the SIGTERM or SIGHUP just taken is
#: the same delivery, not a second signal: a Slurm batch script's ``trap
#: 'kill -TERM $pid' TERM`` (or srun) passes on the SIGTERM Slurm sent dsrun
#: as well, milliseconds later, and must not kill every rank mid-save. Only
#: one copy is absorbed, so a burst (``timeout`` signalling the group) is
#: still a second signal. SIGINT is never merged: a terminal sends one per
#: Ctrl-C pressed, and a second Ctrl-C kills at once, however quick.
MERGE = 0.25
#: The signals whose copies are merged (MERGE).
MERGED = frozenset({signal.SIGTERM, signal.SIGHUP})


class Interrupted(Exception):
    """Raised by the launcher's signal handlers (SIGINT, SIGTERM, SIGHUP)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class SignalLatch:
    """The launcher's handler of SIGINT, SIGTERM and SIGHUP.

    While a job starts (:meth:`arm`) the first signal raises
    :class:`Interrupted`, which aborts a blocking connect or preflight.
    Every other signal - the ones after it, and all of them while the job is
    supervised or stopped (:meth:`hold`) - is only recorded in ``pending``
    for the supervisor's loop to act on, so none can escape from the middle
    of stopping the job or of a message to an agent. One copy of a SIGTERM
    or SIGHUP that comes within :data:`MERGE` of the same signal is dropped."""

    def __init__(self, clock: Callable[[], float] = time.monotonic, merge: bool = True) -> None:
        self.clock = clock
        self.merge = merge  # copies are merged (MERGE): while a job runs (jobsignals.py)
        # the last signal taken, and when, while one copy of it may still come
        self.copy_of: tuple[int, float] | None = None
        self.pending: list[int] = []
        self.raising = False
        self.seen = False  # any signal since reset(): the launcher keeps its handlers
        self.received = 0  # signals since reset()
        self.first: int | None = None  # the first of them
        # Once ``received`` reaches ``exit_at``, ``on_excess(signum)`` (which
        # must not return: the process is ending and blocked; launch.py).
        self.exit_at: int | None = None
        self.on_excess: Callable[[int], None] | None = None

    def __call__(self, signum: int, frame: object) -> None:
        self.seen = True
        self.received += 1
        if self.first is None:
            self.first = signum
        if self.exit_at is not None and self.received >= self.exit_at \
                and self.on_excess is not None:
            self.on_excess(signum)
        now, copy_of = self.clock(), self.copy_of
        if copy_of is not None and copy_of[0] == signum and now - copy_of[1] < MERGE \
                and signum in MERGED and self.merge:
            self.copy_of = None  # the same delivery again (MERGE): once
            return
        self.copy_of = (signum, now)
        if self.raising:
            self.raising = False
            raise Interrupted(signum)
        self.pending.append(signum)

    def reset(self, merge: bool = False) -> None:
        self.merge = merge
        self.pending.clear()
        self.raising = False
        self.seen = False
        self.received = 0
        self.first = None
        self.copy_of = None
        self.exit_at = None

    def arm(self) -> None:
        """Raise from now on; a signal recorded before raises at once."""
        if self.pending:
            raise Interrupted(self.pending.pop(0))
        self.raising = True

    def hold(self) -> None:
        self.raising = False

    def take(self) -> list[int]:
        """The signals recorded since the last call, oldest first."""
        taken, self.pending[:] = list(self.pending), []
        return taken


#: The one latch the launcher's signal handlers are (launch.JOB_SIGNALS).
SIGNALS = SignalLatch()


class Forwards:
    """The launcher's handler of SIGUSR1 and SIGUSR2: each one is recorded
    (never raised, never counted as a stop) for the supervisor to forward."""

    def __init__(self) -> None:
        self.pending: list[int] = []

    def __call__(self, signum: int, frame: object) -> None:
        self.pending.append(signum)  # list.append: no lock a handler could wait on

    def take(self) -> list[int]:
        taken, self.pending[:] = list(self.pending), []
        return taken


#: The signals forwarded to the ranks, never a stop (launcher and agents).
FORWARDED = (signal.SIGUSR1, signal.SIGUSR2)
#: The one forwarding handler the launcher has (launch.JOB_SIGNALS).
FORWARDS = Forwards()
