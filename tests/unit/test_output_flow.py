"""Rank output on its way to dsrun's stdout, without processes: the
console's writer threads (nobody waits for a slow reader; stderr does not
wait behind stdout; order kept; a closed pipe raises in the caller; a
stalled stream given up on), the end of a job's output (signals, the
bounded wait), the agent link's pause/resume and batches, and the
supervisor pausing the agents while the console is behind."""

from __future__ import annotations

import io
import os
import queue
import select
import signal
import threading
import time

import pytest

from dsrun.errors import DsrunUsageError
from dsrun.launcher import console as console_mod
from dsrun.launcher import launch, protocol
from dsrun.launcher import link as link_mod
from dsrun.launcher.console import Console
from dsrun.launcher.link import Link
from dsrun.launcher.supervisor import OUTPUT_HIGH, OUTPUT_LOW, SIGNALS, Supervisor, Watch
from dsrun.launcher.watch import RankState, Stragglers


class SlowStream(io.StringIO):
    """A stdout whose reader takes nothing until ``go`` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.go = threading.Event()
        self.writes = 0

    def write(self, text: str) -> int:
        self.go.wait()
        self.writes += 1
        return super().write(text)


class ClosedPipe(io.StringIO):
    def write(self, text: str) -> int:
        raise BrokenPipeError(32, "Broken pipe")


def test_console_writer_never_makes_the_caller_wait_and_keeps_order() -> None:
    out, err = SlowStream(), SlowStream()
    c = Console(out, err, tty=False)
    c.start_writer()
    for i in range(1000):
        c.lines("h", 0, 1, [f"a{i}", f"b{i}"])  # returns although nothing is read
    c.say("after the lines")
    assert c.backlog > 1000 * 2 * len("[h:0] a0\n")
    out.go.set()
    err.go.set()
    c.close()
    assert c.backlog == 0
    expected = "".join(f"[h:0] a{i}\n[h:0] b{i}\n" for i in range(1000))
    assert out.getvalue() == expected
    assert err.getvalue() == "dsrun: after the lines\n"
    assert out.writes < 1000  # queued texts of one stream go out together
    c.line("h", 1, 1, "direct again")  # after close(): written at once
    assert out.getvalue().endswith("[h:1] direct again\n")


def test_a_closed_pipe_raises_in_the_caller_and_other_streams_go_on() -> None:
    err = io.StringIO()
    c = Console(ClosedPipe(), err, tty=False)
    c.start_writer()
    c.line("h", 0, 1, "first")  # queued: the writer finds the pipe closed
    c.say("still said")
    with pytest.raises(BrokenPipeError):
        for _ in range(200):  # the supervisor asks at every step
            c.pending()
            threading.Event().wait(0.01)
    with pytest.raises(BrokenPipeError):
        c.line("h", 0, 1, "more")
    assert c.close() is True  # the last write failed: the caller learns it here too
    assert err.getvalue() == "dsrun: still said\n"
    assert c.backlog == 0
    ok = Console(io.StringIO(), io.StringIO(), tty=False)
    ok.start_writer()
    ok.line("h", 0, 1, "x")
    assert ok.close() is False


def test_a_stream_that_cannot_encode_gets_replacements_not_a_dead_console() -> None:
    raw = io.BytesIO()
    ascii_out = io.TextIOWrapper(raw, encoding="ascii", write_through=True)
    c = Console(ascii_out, io.StringIO(), tty=False)
    c.start_writer()
    c.line("h", 0, 1, "caf\u00e9")
    c.line("h", 0, 1, "next")
    c.close()
    assert raw.getvalue() == b"[h:0] caf?\n[h:0] next\n"


def _wait(cond, timeout: float = 5.0) -> bool:
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            return False
        time.sleep(0.01)
    return True


def test_stderr_does_not_wait_behind_a_stalled_stdout() -> None:
    out, err = SlowStream(), io.StringIO()
    c = Console(out, err, tty=False)
    c.start_writer()
    for i in range(100):
        c.lines("h", 0, 1, [f"out {i}"])
    c.lines("h", 0, 2, ["a rank's stderr"])
    c.say("the report")
    assert _wait(lambda: err.getvalue() == "[h:0] a rank's stderr\ndsrun: the report\n")
    assert out.getvalue() == "" and c.behind(1) > 0 and c.behind(2) == 0
    assert c.pending() == c.behind(1)  # the pause mark counts both streams
    assert not c.written(0.1)  # stdout still waits for its reader
    out.go.set()
    assert c.close() is False
    assert out.getvalue() == "".join(f"[h:0] out {i}\n" for i in range(100))


def test_one_file_behind_both_streams_keeps_the_order_things_were_said(tmp_path) -> None:
    path = tmp_path / "log"
    with open(path, "w") as out, open(os.dup(out.fileno()), "w") as err:
        assert console_mod._same_file(out, err)  # `>log 2>&1`: one file, one writer
        assert not console_mod._same_file(out, io.StringIO())
        c = Console(out, err, tty=False)
        c.start_writer()
        for i in range(200):
            c.line("h", 0, 1 + i % 2, f"line {i}")
            if i % 50 == 49:
                c.say(f"said after {i}")
        c.close()
    got = path.read_text().splitlines()
    expected = []
    for i in range(200):
        expected.append(f"[h:0] line {i}")
        if i % 50 == 49:
            expected.append(f"dsrun: said after {i}")
    assert got == expected


def test_a_long_text_goes_out_in_chunks_cut_at_line_ends() -> None:
    out = io.StringIO()
    sizes: list[int] = []
    real_write = out.write
    out.write = lambda text: sizes.append(len(text)) or real_write(text)  # type: ignore
    c = Console(out, io.StringIO(), tty=False)
    c.start_writer()
    lines = [f"{i:06d}" + "z" * 993 for i in range(300)]  # 300 KB in one call
    c.lines("h", 0, 1, lines)
    c.close()
    assert out.getvalue() == "".join(f"[h:0] {line}\n" for line in lines)
    assert len(sizes) > 4 and max(sizes) <= console_mod.CHUNK
    assert all(size % 1006 == 0 for size in sizes)  # whole lines only


def test_a_stalled_stream_is_seen_and_can_be_given_up_on() -> None:
    out, err = SlowStream(), io.StringIO()
    c = Console(out, err, tty=False)
    c.start_writer()
    assert c.stuck(1) == 0.0  # idle is not stuck
    c.lines("h", 0, 1, ["first"])  # taken by the writer, which blocks in its write
    assert _wait(lambda: c._writers[1].busy)
    c.lines("h", 0, 1, ["x\u00e9"] * 10)  # queued behind it
    time.sleep(0.3)
    assert 0.25 <= c.stuck(1) and c.stuck(1, since=time.monotonic()) < 0.1
    assert c.drop(1) == (10, 10 * len("[h:0] x\u00e9\n".encode()))
    assert c.written(0.1)  # a stream given up on is not waited for
    c.line("h", 0, 1, "after the drop")  # silently taken: nobody can read it
    c.say("still said")
    assert c.written(1.0)
    began = time.monotonic()
    assert c.close(wait=False) is False  # the blocked writer is left behind
    assert time.monotonic() - began < 5  # not blocked with the writer (until go)
    c.line("h", 0, 1, "after close")  # still dropped: a direct write would block
    assert err.getvalue() == "dsrun: still said\n"
    out.go.set()
    assert _wait(lambda: out.getvalue() == "[h:0] first\n")


@pytest.fixture
def job_console(monkeypatch):
    """launch's console over a stdout nobody reads, with lines queued."""
    out, err = SlowStream(), io.StringIO()
    c = Console(out, err, tty=False)
    monkeypatch.setattr(launch, "console", c)
    SIGNALS.reset()
    c.start_writer()
    c.lines("h", 0, 1, ["line 0"])  # the writer blocks in this write
    assert _wait(lambda: c._writers[1].busy)
    c.lines("h", 0, 1, [f"line {i}" for i in range(1, 1000)])
    c.say("job failed: rank 1 ...")
    yield c, out, err
    SIGNALS.reset()
    out.go.set()


def test_a_signal_while_the_output_drains_drops_stdout_and_writes_stderr(job_console) -> None:
    c, out, err = job_console
    SIGNALS(signal.SIGINT, None)  # recorded, as while the job ran
    began = time.monotonic()
    launch.finish_output(60.0)
    assert time.monotonic() - began < 5  # not the 60 s patience
    c.close(wait=False)
    lines = err.getvalue().splitlines()
    assert lines[0] == "dsrun: job failed: rank 1 ..."
    assert lines[1].startswith("dsrun: SIGINT after the job ended: dropped 999 line(s) (")


def test_a_second_signal_ends_the_wait_at_once(job_console) -> None:
    c, out, err = job_console
    c._writers[2] = c._writers[1]  # stderr behind the same stalled reader (`2>&1 |`)
    c._writers[1].fds = {1, 2}
    c.say("waits behind stdout")
    SIGNALS(signal.SIGTERM, None)
    SIGNALS(signal.SIGTERM, None)
    began = time.monotonic()
    launch.finish_output(60.0)
    assert time.monotonic() - began < 5  # not the 60 s patience


def test_a_reader_that_takes_nothing_is_waited_for_patience_seconds(job_console) -> None:
    c, out, err = job_console
    began = time.monotonic()
    launch.finish_output(0.5)
    assert 0.5 <= time.monotonic() - began < 5  # 0.5 s, not the reader's forever
    assert err.getvalue().splitlines()[-1].startswith(
        "dsrun: nothing was read from dsrun's stdout for 0.5s after the job ended "
        "(DSRUN_OUTPUT_WAIT): dropped 999 line(s) (")


@pytest.mark.parametrize("value", ["nan", "-1", "inf", "soon"])
def test_the_output_wait_variable_is_checked(value) -> None:
    with pytest.raises(DsrunUsageError, match="DSRUN_OUTPUT_WAIT"):
        launch.output_wait({"DSRUN_OUTPUT_WAIT": value})
    assert launch.output_wait({"DSRUN_OUTPUT_WAIT": "0"}) is None
    assert launch.output_wait({}) == launch.DEFAULT_OUTPUT_WAIT


def test_a_straggler_line_says_when_the_output_is_paused() -> None:
    ranks = {0: RankState("a", 1, 0.0), 1: RankState("b", 2, 0.0)}
    ranks[1].ended = 10.0
    s = Stragglers(30.0)
    s.exited(10.0)
    plain = s.line(40.0, ranks)
    held = s.line(100.0, ranks, paused=True)
    assert plain is not None and "still running: rank 0 on a" in plain
    assert "output paused" not in plain
    assert held is not None and held.endswith(" (output paused: dsrun's stdout reader is slow)")


def _link() -> tuple[Link, int, io.BufferedReader]:
    r_in, w_in = os.pipe()  # launcher -> agent
    r_out, w_out = os.pipe()  # agent -> launcher
    link = Link(r_in, os.fdopen(w_out, "wb")).start()
    return link, w_in, os.fdopen(r_out, "rb")


def _read_events(stream: io.BufferedReader, count: int) -> list[dict]:
    return [protocol.decode(stream.readline()) for _ in range(count)]


def test_a_paused_link_holds_output_but_not_control_events() -> None:
    link, w_in, stream = _link()
    try:
        link.pause_output(True)
        link.send({"ev": "out", "rank": 0, "fd": 1, "lines": ["held"]}, control=False)
        link.send({"ev": "exit", "rank": 0})
        assert _read_events(stream, 1) == [{"ev": "exit", "rank": 0}]
        assert select.select([stream], [], [], 0.5)[0] == []  # the output is held
        link.pause_output(False)
        assert _read_events(stream, 1)[0]["lines"] == ["held"]
        link.pause_output(True)
        link.send({"ev": "out", "rank": 0, "fd": 1, "lines": ["last"]}, control=False)
        assert link.drain(5.0)  # the agent's last act writes it even when paused
        assert _read_events(stream, 1)[0]["lines"] == ["last"]
    finally:
        os.close(w_in)
        stream.close()


def test_a_full_output_backlog_makes_the_ranks_pumps_wait(monkeypatch) -> None:
    monkeypatch.setattr(link_mod, "OUTPUT_BACKLOG", 1000)
    link, w_in, stream = _link()
    try:
        link.pause_output(True)
        msg = {"ev": "out", "rank": 0, "fd": 1, "lines": ["x" * 600]}
        link.send(msg, control=False)
        link.send(msg, control=False)  # 2 x ~650 bytes: now over the backlog
        third = threading.Thread(target=link.send, args=(msg,), kwargs={"control": False})
        third.start()
        third.join(1.0)
        assert third.is_alive(), "a pump must wait while the backlog is full"
        link.pause_output(False)
        third.join(5.0)
        assert not third.is_alive()
        assert [e["lines"] for e in _read_events(stream, 3)] == [["x" * 600]] * 3
    finally:
        os.close(w_in)
        stream.close()


class _Handle:
    def __init__(self) -> None:
        self.events: queue.Queue = queue.Queue()
        self.sent: list[str] = []

    def send_all(self, obj, only=None) -> None:
        self.sent.append(obj["cmd"])


def test_supervisor_pauses_agents_while_the_console_is_behind() -> None:
    backlog = [0]
    handle = _Handle()
    got: list[tuple[str, int, int, list[str]]] = []
    sup = Supervisor(handle, ["a"], lambda *a: got.append(a), 1.0,  # type: ignore[arg-type]
                     Watch(output_backlog=lambda: backlog[0]))
    backlog[0] = OUTPUT_HIGH + 1
    sup._handle(0, {"ev": "out", "rank": 3, "fd": 2, "lines": ["x", "y"]})
    sup._pace_output()
    assert got == [("a", 3, 2, ["x", "y"])] and handle.sent == ["pause"]
    sup._handle(0, {"ev": "out", "rank": 3, "fd": 1, "line": "old agent"})
    sup._pace_output()
    assert got[-1] == ("a", 3, 1, ["old agent"]) and handle.sent == ["pause"]
    backlog[0] = (OUTPUT_HIGH + OUTPUT_LOW) // 2
    sup._pace_output()
    assert handle.sent == ["pause"]  # between the marks: no change
    backlog[0] = OUTPUT_LOW - 1
    sup._pace_output()
    assert handle.sent == ["pause", "resume"]
