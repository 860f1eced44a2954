"""An agent's own stop signal that arrives after its supervision ended is
told to the launcher (before ``done``) only when a rank died of a stop
signal outside the agent's stop: then the deaths and the signal are one
job-wide signal. Ranks that all exited on their own decide the outcome, so a
signal reaching the agent during its teardown must not turn a job whose
ranks all exited 0 into "stopped by SIGTERM" (exit 143)."""

from __future__ import annotations

import signal
import time
from types import SimpleNamespace
from typing import Any

import pytest

from dsrun.launcher import agent as agent_mod


def _finish_with(killed_outside: bool, monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    monkeypatch.setattr(agent_mod, "stop_raising", lambda then=None: None)
    sent: list[dict[str, Any]] = []
    stand_in = SimpleNamespace(
        _supervise=lambda: None, _crashed=lambda exc: None, _hurry=lambda signum: None,
        _await_own_signal=lambda: None, _finish=lambda: {"killed": 0},
        late_signal=True, signalled=(signal.SIGTERM, time.monotonic()),
        killed_outside=killed_outside, failed=False, emit=sent.append,
        _emit_signal=lambda signum, late, age: sent.append({"ev": "signal", "signal": signum}))
    assert agent_mod.Agent.run(stand_in) == 0  # type: ignore[arg-type]
    return sent


def test_a_late_signal_is_told_when_a_rank_died_of_a_stop_signal(
        monkeypatch: pytest.MonkeyPatch) -> None:
    assert [m["ev"] for m in _finish_with(True, monkeypatch)] == ["signal", "done"]


def test_a_late_signal_after_ranks_exited_on_their_own_is_not_told(
        monkeypatch: pytest.MonkeyPatch) -> None:
    assert [m["ev"] for m in _finish_with(False, monkeypatch)] == ["done"]
