"""SshBackend.open connects in daemon threads: an exception in a connect
thread - from the connect itself or from the launcher's ``on_connect``
callback - is raised by open(), never leaves it waiting forever, and no
channel stays open."""

from __future__ import annotations

import io
import threading
from types import SimpleNamespace
from typing import IO

from dsrun.launcher.backends.base import AgentChannel
from dsrun.launcher.backends.ssh import SshBackend
from dsrun.launcher.envpolicy import JobEnv


class _Channel(AgentChannel):
    def __init__(self, host: str) -> None:
        self.host = host
        self.killed = False

    def stdin(self) -> IO[bytes]:
        return io.BytesIO()

    def stdout(self) -> IO[bytes]:
        return io.BytesIO()

    def kill(self) -> None:
        self.killed = True

    def wait(self, timeout: float | None = None) -> int | None:
        return 0


def _open(backend: SshBackend, on_connect) -> object:  # noqa: ANN001
    plan = SimpleNamespace(nodes=[SimpleNamespace(host=h, local=False) for h in ("a", "b")],
                           cwd="/", user_env=JobEnv())
    outcome: list[object] = []

    def call() -> None:
        try:
            outcome.append(backend.open(plan, lambda *a: None, on_connect))  # type: ignore
        except BaseException as exc:  # noqa: BLE001 - what the test looks at
            outcome.append(exc)

    thread = threading.Thread(target=call, daemon=True)
    thread.start()
    thread.join(10)
    assert outcome, "SshBackend.open never returned"
    return outcome[0]


def test_an_error_in_on_connect_is_raised_by_open(monkeypatch):
    made: list[_Channel] = []

    def open_one(self, host, cwd, is_local, pythonpath=None):  # noqa: ANN001
        made.append(_Channel(host))
        return made[-1]

    def on_connect(host: str) -> None:
        if host == "b":
            raise RuntimeError("the console broke")

    monkeypatch.setattr(SshBackend, "_open_one", open_one)
    outcome = _open(SshBackend(lookup=lambda host: {}, environ={}), on_connect)
    assert isinstance(outcome, RuntimeError) and str(outcome) == "the console broke"
    assert len(made) == 2 and all(c.killed for c in made), "a channel was left open"


def test_an_error_in_a_connect_is_raised_by_open(monkeypatch):
    def open_one(self, host, cwd, is_local, pythonpath=None):  # noqa: ANN001
        if host == "a":
            raise ValueError("bad target")
        return _Channel(host)

    monkeypatch.setattr(SshBackend, "_open_one", open_one)
    outcome = _open(SshBackend(lookup=lambda host: {}, environ={}), lambda host: None)
    assert isinstance(outcome, ValueError)


def test_no_hosts_opens_nothing():
    backend = SshBackend(lookup=lambda host: {}, environ={})
    plan = SimpleNamespace(nodes=[], cwd="/", user_env=JobEnv())
    assert backend.open(plan, lambda *a: None).channels == []  # type: ignore[arg-type]
