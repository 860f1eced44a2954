"""What a host prints on the agent's stdout besides messages - a login
shell's greeting, a forced command's or nologin's refusal - is kept: the
agent's first message is read even when such text lacks its newline, and
the messages about an agent that exited or never answered quote it."""

from __future__ import annotations

import io
import os
import queue
import time
from typing import IO, Any

import pytest

from dsrun.launcher import protocol
from dsrun.launcher.backends.base import AgentChannel, JobHandle, split_glued
from dsrun.launcher.cluster import Cluster, _Probe

FACTS = {"ev": "facts", "host": "beta", "pid": 7, "master": {"addr": "fd21::12", "port": 5}}


class PipeChannel(AgentChannel):
    """An agent whose stdout (and stderr) the test writes through pipes."""

    watched = False

    def __init__(self, host: str, with_stderr: bool = False) -> None:
        self.host = host
        r, self.out_w = os.pipe()
        self._out = os.fdopen(r, "rb")
        self._err: IO[bytes] | None = None
        self.err_w = -1
        if with_stderr:
            r, self.err_w = os.pipe()
            self._err = os.fdopen(r, "rb")
        self._in = io.BytesIO()
        self.code: int | None = None

    def write(self, data: bytes, fd: int | None = None) -> None:
        os.write(self.out_w if fd is None else fd, data)

    def finish(self, code: int) -> None:
        self.code = code
        for fd in (self.err_w, self.out_w):
            if fd >= 0:
                os.close(fd)

    def stdin(self) -> IO[bytes]:
        return self._in

    def stdout(self) -> IO[bytes]:
        return self._out

    def stderr(self) -> IO[bytes] | None:
        return self._err

    def kill(self) -> None:
        pass

    def wait(self, timeout: float | None = None) -> int | None:
        return self.code


def events_until(handle: JobHandle, last: str, timeout: float = 5.0) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    end = time.monotonic() + timeout
    while not out or out[-1].get("ev") != last:
        out.append(handle.events.get(timeout=max(end - time.monotonic(), 0.01))[1])
    return out


@pytest.fixture
def chan():  # noqa: ANN201 - a PipeChannel, its pipes closed afterwards
    channel = PipeChannel("beta", with_stderr=True)
    yield channel
    if channel.code is None:
        channel.finish(0)


def test_text_without_newline_before_the_first_message_is_split_off(chan) -> None:
    handle = JobHandle([chan])
    chan.write(b"Welcome to the cluster" + protocol.encode(FACTS))
    chan.write(protocol.encode({"ev": "hb"}))
    # once the agent speaks, its stdout is its own: nothing is split any more
    late = "late text" + protocol.encode({"ev": "hb"}).decode().strip()
    chan.write(late.encode() + b"\n")
    chan.finish(0)
    evs = events_until(handle, "eof")
    assert [(e["ev"], e.get("line")) for e in evs] == [
        ("garbage", "Welcome to the cluster"), ("facts", None), ("hb", None),
        ("garbage", late), ("eof", None)]
    assert {k: v for k, v in evs[1].items() if k != "_recv"} == FACTS
    assert list(handle.tails[0]) == ["Welcome to the cluster", late]


def test_braces_in_the_text_do_not_hide_the_message(chan) -> None:
    handle = JobHandle([chan])
    chan.write(b'motd {"a": 1} and {"b":' + protocol.encode(FACTS))
    chan.finish(0)
    evs = events_until(handle, "eof")
    assert [e["ev"] for e in evs] == ["garbage", "facts", "eof"]
    assert evs[0]["line"] == 'motd {"a": 1} and {"b":'


@pytest.mark.parametrize("line", [
    b"hello\n", b'{"ev": "facts"\n', b'x{"no_ev": 1}\n', b'x{"ev": 1} trailing\n',
    b'x{"ev": [1}\n', b"\n", b"x{\"\n"])
def test_lines_without_a_whole_message_at_their_end_stay_text(line: bytes) -> None:
    assert split_glued(line) is None


def test_an_exit_quotes_what_the_host_printed_on_stdout(chan) -> None:
    handle = JobHandle([chan])
    chan.write(b"This account is currently not available.\n")
    chan.finish(1)
    events_until(handle, "eof")
    assert handle.exit_message(0, 1) == ("node agent on beta exited unexpectedly (status 1): "
                                         "This account is currently not available.")


def test_an_exit_quotes_the_last_line_of_stdout_and_stderr(chan) -> None:
    handle = JobHandle([chan])
    chan.write(b"Please login as the user \"ubuntu\" rather than the user \"root\".\n\n")
    events_until(handle, "garbage")
    events_until(handle, "garbage")
    chan.write(b"you have no access to this node\n", chan.err_w)
    events_until(handle, "agent_err")
    chan.finish(142)
    events_until(handle, "eof")
    assert handle.exit_message(0, 142).endswith("(status 142): you have no access to this node")
    assert handle.printed(0) == (' (it printed: Please login as the user "ubuntu" rather than '
                                 'the user "root". | you have no access to this node)')


def test_a_probe_that_times_out_quotes_what_the_host_printed() -> None:
    quiet, talker = PipeChannel("alpha"), PipeChannel("beta")
    try:
        handle = JobHandle([quiet, talker])
        talker.write(b"Please login as the user \"ubuntu\" rather than the user \"root\".\n\n")
        deadline = time.monotonic() + 1.0
        while not handle.tails[1]:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        cluster = Cluster("hf", ("alpha", "beta"), ((0,), (0,)), (False, False), "ssh")
        probe = _Probe(handle, cluster, 0.3, time.monotonic() + 0.3, [None, None],
                       [None, None])
        probe.collect({0, 1})
        assert probe.errors == [
            "the node agent on alpha did not answer within 0.3s (--ssh_timeout)",
            "the node agent on beta did not answer within 0.3s (--ssh_timeout) (it printed: "
            "Please login as the user \"ubuntu\" rather than the user \"root\".)"]
        probe.requeue()  # the text is still shown as the host's lines
        shown = []
        while True:
            try:
                shown.append(handle.events.get_nowait()[1])
            except queue.Empty:
                break
        assert [e["line"] for e in shown if e["ev"] == "garbage"] == [
            "Please login as the user \"ubuntu\" rather than the user \"root\".", ""]
    finally:
        quiet.finish(0)
        talker.finish(0)
