"""Holding the node agent's stop signals over a step that must not be cut.

The agent's stop signals raise :class:`agent_os.Stop` in its main thread,
between any two bytecodes. Some steps must happen whole or not at all:
reporting a rank's exit marks the rank reported and then sends its
``exit`` event, and a Stop in between would lose the event for good (the
supervision that resumes after the Stop skips ranks already reported, and
the launcher then finds a ``done`` without that rank's exit).
:func:`held_signals` keeps the signals that come during such a step and
hands each to the handler that was in place once the step is over (the
Stop is then raised after it, where the state is whole again). Kept to the
standard library: every agent imports it.

A signal is never dropped, and never hides the step's own error: what a
handler cannot be given - the signals after one whose handler raised (the
Stop goes up first; the next is for the handler the agent installs once
it has caught it), and every signal held over a step that raised (the
step's error goes up, not a Stop) - is kept for :func:`take_held`, whose
caller passes each on once it has handled the exception.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from typing import Any

from dsrun.launcher.agent_os import STOP_SIGNALS

_later: list[int] = []  # held signals no handler was given yet (take_held)


@contextlib.contextmanager
def held_signals() -> Iterator[None]:
    """Hold the stop signals that arrive inside the ``with`` block; then give
    each, in order, to the handler that was installed before it, until one
    raises (module docstring). A no-op off the main thread (an agent driven
    by a test's thread: the signals are not its own)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held: list[int] = []
    before = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}
    for sig in STOP_SIGNALS:
        signal.signal(sig, lambda signum, frame: held.append(signum))
    try:
        yield
    except BaseException:
        _restore(before)
        _later.extend(held)  # the step's error goes up, unmasked
        raise
    _restore(before)
    _replay(held, before)


def take_held() -> list[int]:
    """The held signals no handler has had yet, oldest first; forgotten here."""
    taken = list(_later)
    del _later[:len(taken)]
    return taken


def _restore(before: dict[signal.Signals, Any]) -> None:
    for sig, handler in before.items():
        signal.signal(sig, handler)


def _replay(held: list[int], before: dict[signal.Signals, Any]) -> None:
    for i, signum in enumerate(held):
        handler = before[signal.Signals(signum)]
        try:
            if handler == signal.SIG_DFL:  # what it would have done: end the process
                signal.raise_signal(signum)
            elif callable(handler):  # raise_stop raises here, once the step is whole
                handler(signum, None)
        except BaseException:
            _later.extend(held[i + 1:])
            raise
