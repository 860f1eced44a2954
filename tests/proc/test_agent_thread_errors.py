"""An error in one of the node agent's threads (output readers, rank
waiters), not only on its main thread, fails the host: a ``fail`` event,
the ranks stopped, ``done`` sent, a non-zero status. The agent runs in a
thread of the test (so its signal handling is not the test process's) with
a real rank process."""

from __future__ import annotations

import errno
import json
import os
import shutil
import sys
import threading
import time

import pytest

from dsrun.launcher import agent as agent_mod
from dsrun.launcher import agent_output
from dsrun.launcher.link import Link
from tests.conftest import alive


def _run_agent(tmp_path, argv: list[str]) -> tuple[list[dict], int | None]:
    """Run an Agent on one rank ``argv``; its events and its status."""
    cmd_read, cmd_write = os.pipe()  # the launcher's commands: none, kept open
    ev_read, ev_write = os.pipe()
    link = Link(cmd_read, os.fdopen(ev_write, "wb")).start()
    payload = {"job_id": "e" * 32, "kill_grace": 1, "cwd": str(tmp_path), "env": {},
               "ranks": [{"rank": 0, "local_rank": 0, "argv": argv, "runtime": True,
                          "env": {"dsrun": {"RANK": "0"}, "defaults": {},
                                  "path_prepend": []}}]}
    agent = agent_mod.Agent(payload, link, guard=None)
    status: list[int] = []
    thread = threading.Thread(target=lambda: status.append(agent.run()), daemon=True)
    thread.start()
    events: list[dict] = []
    with os.fdopen(ev_read, "rb") as stream:
        end = time.monotonic() + 30
        for line in stream:
            events.append(json.loads(line))
            if events[-1].get("ev") == "done" or time.monotonic() > end:
                break
    thread.join(10)
    os.close(cmd_write)
    shutil.rmtree(agent.tmpdir, ignore_errors=True)
    return events, status[0] if status else None


def _talker(flag) -> list[str]:  # noqa: ANN001 - a path
    return [sys.executable, "-c",
            f"import os, time; open({str(flag)!r}, 'w').write(str(os.getpid())); "
            "print('hello', flush=True); time.sleep(60)"]


def test_an_error_in_an_output_reader_fails_the_host_and_stops_the_rank(tmp_path, monkeypatch):
    def broken(self, rank, fd, segments):  # noqa: ANN001 - RankOutput.forward's signature
        if segments:
            raise RuntimeError("a reader's bug")

    monkeypatch.setattr(agent_output.RankOutput, "forward", broken)
    flag = tmp_path / "pid"
    events, status = _run_agent(tmp_path, _talker(flag))
    kinds = [e.get("ev") for e in events]
    assert "fail" in kinds and kinds[-1] == "done" and status == 1, events
    fail = next(e for e in events if e.get("ev") == "fail")
    assert fail["message"] == "its own error: RuntimeError: a reader's bug", fail
    assert not alive(int(flag.read_text())), "the rank was left running"


def test_an_error_in_a_rank_waiter_still_reports_the_exit_and_ends(tmp_path, monkeypatch):
    def broken(info):  # noqa: ANN001 - a waitid result
        raise RuntimeError("a waiter's bug")

    monkeypatch.setattr(agent_mod, "wait_status", broken)
    events, status = _run_agent(tmp_path, [sys.executable, "-c", "raise SystemExit(3)"])
    kinds = [e.get("ev") for e in events]
    assert kinds[-1] == "done" and status == 1, events
    assert next(e for e in events if e.get("ev") == "fail")["message"] == \
        "its own error: RuntimeError: a waiter's bug"
    exits = [e for e in events if e.get("ev") == "exit"]
    assert [(e["rank"], e["code"]) for e in exits] == [(0, 3)], events


class _FullDisk:
    """A log file on a full disk: every write is taken, every flush fails."""

    name = "/full/rank_0.log"

    def __init__(self) -> None:
        self.closed = False

    def write(self, text: str) -> int:
        return len(text)

    def flush(self) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def close(self) -> None:
        self.closed = True
        self.flush()  # as io's close: flushes first, and raises again


def test_a_log_that_cannot_be_written_is_dropped_and_said_once():
    said: list[str] = []
    sent: list[dict] = []

    class _Link:
        def send(self, obj: dict, control: bool = True) -> None:
            sent.append(obj)

    output = agent_output.RankOutput(_Link(), said.append, pytest.fail)  # type: ignore[arg-type]
    rank = agent_output.Rank(0, 0, None, None, "", "")  # type: ignore[arg-type]
    log = _FullDisk()
    rank.log = log  # type: ignore[assignment]
    output.write_log(rank, "one\n")
    output.write_log(rank, "two\n")
    output.close_log(rank)  # the teardown's close: must not raise
    assert said == ["cannot write the --log_dir file /full/rank_0.log of rank 0: "
                    "[Errno 28] No space left on device"]
    assert rank.log is None and log.closed
