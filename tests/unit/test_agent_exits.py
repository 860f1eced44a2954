"""The node agent's exit event: which error record is the rank's own, and
what a rank that cannot be started is told."""

from __future__ import annotations

import errno
import signal
import time
from types import SimpleNamespace

from dsrun.launcher.agent_exits import exit_event, own_error
from dsrun.launcher.agent_os import start_error
from dsrun.launcher.agent_output import Rank


def _rank(pid: int, status: int) -> Rank:
    rank = Rank(1, 1, SimpleNamespace(pid=pid), None, "", "")  # type: ignore[arg-type]
    rank.status, rank.exit_mono = status, time.monotonic()
    return rank


def _record(pid: int | None) -> dict:
    record = {"time": time.time() - 5.0, "exit_code": 1, "message": "boom"}
    return record if pid is None else {**record, "pid": pid}


def test_a_record_written_by_another_pid_is_not_the_ranks():
    assert own_error(_rank(100, 1), _record(101)) is None
    mine = _record(100)
    assert own_error(_rank(100, 1), mine) is mine
    assert own_error(_rank(100, 1), _record(None)) is not None  # no pid: an older runtime


def test_a_rank_the_stop_killed_keeps_its_signal_when_the_record_is_a_childs():
    """Stopped at once by SIGTERM, with a child's record 5 s old: the rank
    neither fails first nor takes the record's exit code."""
    stop = time.monotonic()
    event = exit_event(_rank(100, -signal.SIGTERM), _record(101), True, stop - 0.001)
    assert (event["code"], event["signal"], event["error"]) == (None, signal.SIGTERM, None)
    assert event["during_stop"] and event["age"] < 1.0
    own = exit_event(_rank(100, -signal.SIGTERM), _record(100), True, stop)
    assert (own["code"], own["error"]["message"]) == (1, "boom")  # its own: failing first


def test_e2big_names_the_largest_variable_never_its_value():
    exc = OSError(errno.E2BIG, "Argument list too long")
    env = {"PATH": "/bin", "SECRET_TOKEN": "v" * 140_000}
    said = start_error("/py", exc, ["/py", "x.py"], env)
    assert said.startswith("cannot start /py: Argument list too long: the environment is too big")
    assert "the largest is SECRET_TOKEN, 140 kB, over Linux's limit of 128 KiB" in said
    assert "vvv" not in said
    args = start_error("/py", exc, ["/py", "a" * 200_000], {"PATH": "/bin"})
    assert "the arguments are too big" in args and "argument 1, 200 kB" in args
    other = start_error("/py", OSError(errno.ENOENT, "No such file or directory"), [], env)
    assert other == "cannot start /py: No such file or directory"
