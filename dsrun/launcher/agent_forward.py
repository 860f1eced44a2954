"""SIGUSR1 and SIGUSR2 in the node agent: never a stop, never its death;
passed on to its ranks' process groups (as torchrun's
``--signals_to_handle`` passes on the signals listed there).

Such a signal reaches the agent two ways: the launcher's ``signal``
command (dsrun itself got it: ``kill -USR1 $LAUNCHER_PID`` in a Slurm
batch script's trap) or the agent's own handler. A signal sent to every
process of the job (Slurm's ``scancel --signal=USR1 --full``, a signal to
the job's cgroup) reaches the ranks directly, and the agent and the
launcher too; so a rank gets one copy, not two:

- the launcher's command is forwarded, unless the agent itself got the
  same signal within :data:`MERGE` seconds before (then everyone got it);
- the agent's own signal is forwarded only if no command for it follows
  within :data:`MERGE` seconds (it was sent to the agent alone: ``srun``
  passing on a signal to its tasks), and not at all if a forward of it went
  out within :data:`MERGE` seconds before (the launcher was quicker).

Signals are taken while the job runs; once it is being stopped they are
dropped. The handler only appends to a list (a signal handler must not
take a lock the code it interrupted may hold). Standard library only.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable

#: The signals forwarded to the ranks (latch.FORWARDED on the launcher's side).
FORWARDED = (signal.SIGUSR1, signal.SIGUSR2)
#: Seconds within which the agent's own copy of a signal and the
#: launcher's command for it are taken for one delivery to the whole job.
MERGE = 0.5

#: (signum, from the launcher): appended by the handler and the command reader.
_PENDING: list[tuple[int, bool]] = []


def on_signal(signum: int, frame: object) -> None:
    """The agent's handler of :data:`FORWARDED` (installed before any thread)."""
    _PENDING.append((int(signum), False))


def install() -> None:
    for sig in FORWARDED:
        signal.signal(sig, on_signal)


def from_launcher(name: object) -> None:
    """The launcher's ``signal`` command {"signal": "SIGUSR1"} (other names: ignored)."""
    sig = next((s for s in FORWARDED if s.name == name), None)
    if sig is not None:
        _PENDING.append((int(sig), True))


def take() -> list[tuple[int, bool]]:
    taken, _PENDING[:] = list(_PENDING), []
    return taken


class Forwarder:
    """When the agent forwards which signal (see the module docstring);
    ``send(signum)`` signals the running ranks' groups."""

    def __init__(self, send: Callable[[int], None],
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.send = send
        self.clock = clock
        self.heard: dict[int, float] = {}  # the agent's own copy, last seen
        self.sent: dict[int, float] = {}  # the last forward
        self.waiting: dict[int, float] = {}  # own copies not yet forwarded

    def note(self, signum: int, launcher: bool) -> None:
        now = self.clock()
        if launcher:
            if now - self.heard.get(signum, -MERGE - 1) <= MERGE:
                self.waiting.pop(signum, None)  # sent to every process: the ranks have it
                return
            self._send(signum, now)
        elif now - self.sent.get(signum, -MERGE - 1) > MERGE:
            self.heard[signum] = now
            self.waiting.setdefault(signum, now)

    def settle(self) -> None:
        """Forward the agent's own copies that no command followed."""
        now = self.clock()
        for signum, at in list(self.waiting.items()):
            if now - at > MERGE:
                del self.waiting[signum]
                self._send(signum, now)

    def drop(self) -> None:
        """The job is being stopped: nothing more is forwarded."""
        self.waiting.clear()

    def _send(self, signum: int, now: float) -> None:
        self.sent[signum] = now
        self.send(signum)
