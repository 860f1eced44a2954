"""The agent's held stop signals (launcher/agent_hold.py): every signal
that came during the held step reaches a handler, in order, once the step
is over, or is kept for take_held(); the step's own error is never
replaced by a Stop; the handlers are back in place however the step ends."""

from __future__ import annotations

import signal
import threading

import pytest

from dsrun.launcher.agent_hold import held_signals, take_held
from dsrun.launcher.agent_os import STOP_SIGNALS, Stop, raise_stop


@pytest.fixture
def handlers():
    """The stop signals raise Stop, as in the agent; the test's own back after."""
    saved = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}
    for sig in STOP_SIGNALS:
        signal.signal(sig, raise_stop)
    take_held()
    yield
    for sig, handler in saved.items():
        signal.signal(sig, handler)
    take_held()


def test_a_signal_held_over_the_step_is_raised_after_it(handlers):
    done = []
    with pytest.raises(Stop) as stop:
        with held_signals():
            signal.raise_signal(signal.SIGTERM)
            done.append("the rest of the step")
    assert done == ["the rest of the step"] and stop.value.signum == signal.SIGTERM
    assert all(signal.getsignal(sig) is raise_stop for sig in STOP_SIGNALS)
    assert take_held() == []


def test_every_held_signal_is_handed_on_in_order(handlers):
    seen: list[int] = []
    for sig in STOP_SIGNALS:
        signal.signal(sig, lambda signum, frame: seen.append(signum))
    with held_signals():
        signal.raise_signal(signal.SIGINT)
        signal.raise_signal(signal.SIGTERM)
        signal.raise_signal(signal.SIGHUP)
    assert seen == [signal.SIGINT, signal.SIGTERM, signal.SIGHUP]


def test_the_signals_after_a_raising_handler_are_kept_not_dropped(handlers):
    # SIGTERM then SIGINT: the Stop goes up; SIGINT is the agent's to pass on
    # to the handler it installs once it has caught the Stop (a hurry).
    with pytest.raises(Stop) as stop:
        with held_signals():
            signal.raise_signal(signal.SIGTERM)
            signal.raise_signal(signal.SIGINT)
    assert stop.value.signum == signal.SIGTERM
    assert take_held() == [signal.SIGINT]
    assert take_held() == []


def test_the_step_s_own_error_is_not_replaced_by_a_held_stop(handlers):
    with pytest.raises(OSError, match="disk full"):
        with held_signals():
            signal.raise_signal(signal.SIGTERM)
            raise OSError("disk full")
    assert all(signal.getsignal(sig) is raise_stop for sig in STOP_SIGNALS)
    assert take_held() == [signal.SIGTERM]  # not lost either


def test_handlers_are_back_after_a_step_that_raised_with_nothing_held(handlers):
    with pytest.raises(ValueError):
        with held_signals():
            raise ValueError("a bug")
    assert all(signal.getsignal(sig) is raise_stop for sig in STOP_SIGNALS)
    assert take_held() == []


def test_off_the_main_thread_nothing_is_held(handlers):
    seen = []

    def step() -> None:
        with held_signals():
            seen.append({sig: signal.getsignal(sig) for sig in STOP_SIGNALS})

    thread = threading.Thread(target=step)
    thread.start()
    thread.join()
    assert seen == [{sig: raise_stop for sig in STOP_SIGNALS}]
