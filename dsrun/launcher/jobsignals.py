"""The launcher's signal handling around a job (launch.py).

While a job runs, SIGINT, SIGTERM and SIGHUP go to the supervisor's latch
(latch.SIGNALS: the first aborts a start, the rest are acted on by the
supervisor's loop), SIGUSR1 and SIGUSR2 are recorded for the supervisor to
forward to the ranks (latch.FORWARDS; they never stop the job, nor kill
dsrun), and SIGTSTP suspends dsrun without its agents taking it for lost.
After the job, a caller of ``launch.run`` gets its own handlers back; the
dsrun program (:data:`PROGRAM`, set by cli.main) ignores SIGUSR1/2 from
then on, and keeps the latch after a job stopped by a signal, so the rest
of a signal burst cannot end it by SIGINT, yet a third signal since the
job ended exits at once.
"""

from __future__ import annotations

import atexit
import os
import signal
import sys
from collections.abc import Callable

from dsrun.launcher.backends.base import JobHandle
from dsrun.launcher.latch import FORWARDED, FORWARDS, SIGNALS


class _Suspension:
    """Ctrl-Z (SIGTSTP) while a job runs: the agents are told to stop
    expecting heartbeats before dsrun stops, and to expect them again once
    it continues, so a suspended launcher is not taken for a lost one."""

    def __init__(self) -> None:
        self.handle: JobHandle | None = None

    def on_tstp(self, signum: int, frame: object) -> None:
        handle = self.handle
        if handle is not None:
            handle.pause_heartbeats()
        signal.signal(signal.SIGTSTP, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTSTP)  # stops here until SIGCONT
        signal.signal(signal.SIGTSTP, self.on_tstp)
        if handle is not None:
            handle.resume_heartbeats()


suspension = _Suspension()


class Program:
    """Whether this process is the ``dsrun`` program (cli.main sets
    :data:`PROGRAM` ``.entry``), which exits once the job is over, or a
    caller of :func:`run` that goes on (tests, a library user)."""

    entry = False


PROGRAM = Program()

#: Signals after the job ended that make the dsrun program exit at once.
EXIT_NOW_AFTER = 3


def release_signals(previous: dict[signal.Signals, object], ended: int) -> None:
    """The job's signal handlers are no longer needed.

    A caller of :func:`run` gets its own handlers back. The dsrun program,
    after a job stopped by a signal, keeps the latch: the rest of a burst
    (Ctrl-C held down, ``timeout`` signalling the group) would otherwise
    end dsrun by SIGINT instead of its exit status 130, and the signals are
    ignored at exit (Python's finalisation would put their default back).
    Still, the :data:`EXIT_NOW_AFTER`-th signal since the job ended exits at
    once with 128+signum: a dsrun blocked writing its last output (a
    reader that stopped reading) is never left to SIGKILL. From here a copy
    of a signal counts again (latch.MERGE is for the job's grace): a second
    signal ends the wait for dsrun's reader at once."""
    SIGNALS.merge = False
    if PROGRAM.entry:  # nothing is forwarded any more, and dsrun must not die of them
        for sig in FORWARDED:
            if signal.getsignal(sig) is FORWARDS:
                signal.signal(sig, signal.SIG_IGN)
    if SIGNALS.seen and PROGRAM.entry:
        SIGNALS.on_excess = _exit_now
        SIGNALS.exit_at = ended + EXIT_NOW_AFTER
        atexit.unregister(_ignore_job_signals)  # once, however many jobs ran
        atexit.register(_ignore_job_signals)
        return
    for sig, handler in previous.items():
        if not (PROGRAM.entry and sig in FORWARDED):
            signal.signal(sig, handler)  # type: ignore[arg-type]


def _exit_now(signum: int) -> None:
    """Exit at once (a signal handler): a line on stderr if it can be written."""
    try:
        os.write(2, f"dsrun: {signal.Signals(signum).name} again after the job ended: "
                    f"exiting now (output not yet written is lost)\n".encode())
    except OSError:
        pass
    os._exit(128 + signum)


def _ignore_job_signals() -> None:
    """At exit, after a job stopped by a signal: write what dsrun's streams
    hold while the latch still ends a blocked write (:func:`release_signals`),
    then ignore the job's signals that reach the latch to the end."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    for sig in JOB_SIGNALS:
        if signal.getsignal(sig) is SIGNALS:
            signal.signal(sig, signal.SIG_IGN)


#: Signals dsrun takes over while a job runs, and what it does on each.
#: All but SIGTERM stay ignored when dsrun started with them ignored:
#: ``nohup`` ignores SIGHUP, and a non-interactive shell's ``&`` SIGINT, so
#: that the job outlives the terminal (as DeepSpeed's launcher does).
JOB_SIGNALS: dict[signal.Signals, Callable[[int, object], None]] = {
    signal.SIGINT: SIGNALS, signal.SIGTERM: SIGNALS,
    signal.SIGHUP: SIGNALS, signal.SIGTSTP: suspension.on_tstp,
    signal.SIGUSR1: FORWARDS, signal.SIGUSR2: FORWARDS,
}
ALWAYS_HANDLED = frozenset({signal.SIGTERM})


def take_signals() -> dict[signal.Signals, object]:
    """Install the job's signal handlers; return the previous ones (to put
    back) of the signals taken over."""
    SIGNALS.reset(merge=True)  # while the job runs, a copy of a SIGTERM is no second one
    FORWARDS.take()  # of an earlier job of this process
    previous: dict[signal.Signals, object] = {}
    for sig, handler in JOB_SIGNALS.items():
        if sig not in ALWAYS_HANDLED and signal.getsignal(sig) == signal.SIG_IGN:
            continue
        previous[sig] = signal.signal(sig, handler)
    return previous
