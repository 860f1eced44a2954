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
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator

from dsrun.launcher.agent_os import STOP_SIGNALS


@contextlib.contextmanager
def held_signals() -> Iterator[None]:
    """Hold the stop signals that arrive inside the ``with`` block; then give
    each, in order, to the handler that was installed before it. A no-op off
    the main thread (an agent driven by a test's thread: the signals are
    not its own)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held: list[int] = []
    before = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}
    for sig in STOP_SIGNALS:
        signal.signal(sig, lambda signum, frame: held.append(signum))
    try:
        yield
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)
        for signum in held:  # raise_stop raises here, once the step is whole
            handler = before[signal.Signals(signum)]
            if callable(handler):
                handler(signum, None)
