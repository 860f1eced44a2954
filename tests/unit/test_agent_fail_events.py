"""The launcher's view of a node agent that failed itself: a ``fail`` event
is a failure of that host, and an agent that says ``done`` without the exit
of every rank it started is never counted as a clean finish."""

from __future__ import annotations

import io
import threading
from typing import IO

from dsrun.launcher import protocol
from dsrun.launcher.backends.base import AgentChannel, JobHandle
from dsrun.launcher.report import JobResult
from dsrun.launcher.supervisor import Supervisor


class ScriptedChannel(AgentChannel):
    """An agent that wrote ``events`` and exited with ``status``."""

    def __init__(self, host: str, events: list[dict], status: int = 0) -> None:
        self.host = host
        self.status = status
        self._out = io.BytesIO(b"".join(protocol.encode(m) for m in events))
        self.ended = threading.Event()

    def stdin(self) -> IO[bytes]:
        return io.BytesIO()

    def stdout(self) -> IO[bytes]:
        return self._out

    def kill(self) -> None:
        pass

    def wait(self, timeout: float | None = None) -> int | None:
        return self.status


def _supervise(*channels: ScriptedChannel) -> JobResult:
    handle = JobHandle(list(channels))  # type: ignore[arg-type]
    return Supervisor(handle, [c.host for c in channels], lambda *a: None,
                      kill_grace=0.1).run()


def _clean(host: str, rank: int) -> list[dict]:
    return [{"ev": "hello", "host": host}, {"ev": "started", "rank": rank, "pid": 10 + rank},
            {"ev": "exit", "rank": rank, "code": 0, "signal": None, "time": 0.0, "age": 0.0,
             "during_stop": False, "error": None, "tail": []},
            {"ev": "done", "killed": 0}]


def test_a_clean_job_has_no_failure():
    result = _supervise(ScriptedChannel("a", _clean("a", 0)), ScriptedChannel("b", _clean("b", 1)))
    assert result.failures == ()


def test_a_fail_event_is_the_hosts_failure():
    events = [{"ev": "hello", "host": "b"},
              {"ev": "fail", "message": "cannot open the --log_dir file /x/rank_1.log: "
                                        "[Errno 30] Read-only file system", "time": 0.0},
              {"ev": "done", "killed": 0}]
    result = _supervise(ScriptedChannel("a", _clean("a", 0)), ScriptedChannel("b", events, 1))
    assert len(result.failures) == 1
    failure = result.failures[0]
    assert failure.host == "b" and failure.rank is None and failure.exit_code == 1
    assert "Read-only file system" in failure.cause()


def test_done_without_the_exit_of_a_started_rank_is_a_failure():
    events = [{"ev": "hello", "host": "b"}, {"ev": "started", "rank": 1, "pid": 11},
              {"ev": "done", "killed": 1}]  # an agent that broke off (older agent's crash)
    result = _supervise(ScriptedChannel("a", _clean("a", 0)), ScriptedChannel("b", events, 1))
    assert [(f.host, f.rank) for f in result.failures] == [("b", None)]
    assert "ended without reporting the exit of rank(s) 1" in result.failures[0].cause()
