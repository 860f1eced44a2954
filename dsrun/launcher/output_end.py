"""The end of a job's output: what dsrun still holds for its stdout and
stderr once the job has ended, written for as long as the readers take it.

stderr does not wait behind stdout (console.py), so the report is out at
once unless stderr's own reader stalls. A reader that takes nothing is
waited for ``DSRUN_OUTPUT_WAIT`` seconds (then the rest is dropped, and
stderr says how much), but never more than :data:`SIGNALLED_OUTPUT_WAIT`
once a signal has stopped the job: whoever sent it (Ctrl-C, a scheduler,
``timeout``) wants dsrun gone, not blocked behind ``| less``. A signal
while it waits drops stdout's rest at once; a second returns at once.
"""

from __future__ import annotations

import signal
import time

from dsrun.launcher.console import ERR, OUT, Console
from dsrun.launcher.supervisor import SIGNALS

#: Seconds the ended job's stdout waits for a reader that takes nothing.
OUTPUT_WAIT_VAR = "DSRUN_OUTPUT_WAIT"
DEFAULT_OUTPUT_WAIT = 60.0
#: The most seconds it waits so once a signal has stopped the job.
SIGNALLED_OUTPUT_WAIT = 3.0


def finish_output(console: Console, patience: float | None,
                  stopped_by: int | None = None) -> None:
    """The job has ended (its report said): write what ``console`` holds
    (module docstring). stdout is waited for as long as its reader takes
    something; once a stream's writer has written nothing for ``patience``
    seconds since the job ended (None: no limit; at most
    SIGNALLED_OUTPUT_WAIT when the signal ``stopped_by`` stopped the job),
    the rest of it is dropped, and a dropped stdout is said on stderr.
    Either way the exit code stays the job's."""
    after = f"after the job ended ({OUTPUT_WAIT_VAR})"
    if stopped_by is not None:
        patience = min(patience or SIGNALLED_OUTPUT_WAIT, SIGNALLED_OUTPUT_WAIT)
        after = (f"after {signal.Signals(stopped_by).name} stopped the job (dsrun then waits "
                 f"at most {SIGNALLED_OUTPUT_WAIT:g}s for its reader)")
    began = time.monotonic()
    signals: list[int] = []
    dropped: set[int] = set()
    while not console.written(0.2):
        signals += SIGNALS.take()
        if len(signals) > 1:
            return  # a second signal: no more waiting (close() drops the rest)
        if signals and OUT not in dropped:
            dropped.add(OUT)
            _drop_output(console, OUT, f"{signal.Signals(signals[0]).name} after the job ended")
        for fd in (OUT, ERR) if patience is not None else ():
            if fd not in dropped and console.stuck(fd, began) >= patience:
                dropped.add(fd)
                _drop_output(console, fd, f"nothing was read from dsrun's stdout for "
                             f"{patience:g}s {after}")


def _drop_output(console: Console, fd: int, why: str) -> None:
    """Give up on one stream; say on stderr what stdout lost."""
    lines, size = console.drop(fd)
    if fd == OUT and size:
        console.say(f"{why}: dropped {lines} line(s) ({_amount(size)}) of output not yet "
                    f"written to stdout")


def _amount(size: int) -> str:
    return f"{size} bytes" if size < 10 * 1024 else \
        f"{size / 1024:.0f} KiB" if size < 10 * 2 ** 20 else f"{size / 2 ** 20:.0f} MiB"
