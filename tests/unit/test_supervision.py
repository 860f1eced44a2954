"""The launcher's supervision, without processes: parallel close, failures
ordered on the launcher's clock, straggler lines, stack collection, the
start-up progress line, and what was removed as dead code."""

from __future__ import annotations

import dataclasses
import inspect
import io
import queue
import signal
import threading
from typing import IO

from dsrun.launcher import protocol
from dsrun.launcher.backends.base import AgentChannel, JobHandle
from dsrun.launcher.console import Console
from dsrun.launcher.report import JobResult, RankFailure, report_lines, root_cause
from dsrun.launcher.supervisor import Supervisor, Watch
from dsrun.launcher.watch import RankState, StackCollection, Stragglers, stack_lines


class HungChannel(AgentChannel):
    """An agent that never exits: wait() only returns at its timeout."""

    def __init__(self, host: str, barrier: threading.Barrier) -> None:
        self.host = host
        self.barrier = barrier
        self.waited_together = False
        self.closed = False
        self._out = io.BytesIO()

    def stdin(self) -> IO[bytes]:
        return io.BytesIO()

    def stdout(self) -> IO[bytes]:
        return self._out

    def kill(self) -> None:
        pass

    def wait(self, timeout: float | None = None) -> int | None:
        try:  # every channel's wait must be running at the same time to pass
            self.barrier.wait(timeout=3)
            self.waited_together = True
        except threading.BrokenBarrierError:
            pass
        return None

    def close(self) -> None:
        self.closed = True


def test_close_waits_for_all_agents_at_once():
    barrier = threading.Barrier(4)
    channels = [HungChannel(f"h{i}", barrier) for i in range(4)]
    JobHandle(channels).close(timeout=5)  # type: ignore[arg-type]
    assert all(c.waited_together for c in channels), "agents were waited for one by one"
    assert all(c.closed for c in channels)


class LinesChannel(HungChannel):
    def __init__(self, host: str, lines: list[dict]) -> None:
        super().__init__(host, threading.Barrier(1))
        self._out = io.BytesIO(b"".join(protocol.encode(m) for m in lines))


def test_events_are_stamped_on_the_launchers_clock_when_read():
    handle = JobHandle([LinesChannel("a", [{"ev": "hello"}])])  # type: ignore[list-item]
    index, msg = handle.events.get(timeout=5)
    assert index == 0 and msg["ev"] == "hello" and isinstance(msg["_recv"], float)
    assert handle.last_seen[0] == msg["_recv"]


def _exit(rank: int, wall: float, recv: float, age: float) -> dict:
    return {"ev": "exit", "rank": rank, "code": 1, "signal": None, "time": wall, "age": age,
            "during_stop": False, "_recv": recv}


def test_root_cause_never_compares_two_hosts_wall_clocks():
    # Rank 3 on host b failed first; host a's clock is 10 s behind b's, so
    # rank 0's later failure carries the smaller wall time.
    first = RankFailure.from_event("b", _exit(3, wall=1000.0, recv=50.0, age=0.2))
    later = RankFailure.from_event("a", _exit(0, wall=991.0, recv=51.0, age=0.1))
    assert (first.seen, later.seen) == (49.8, 50.9)
    assert root_cause([later, first]) is first
    # an agent that waited long before reporting is credited with its delay
    slow = RankFailure.from_event("a", _exit(0, wall=991.0, recv=53.0, age=3.5))
    assert root_cause([first, slow]) is slow
    lines = report_lines(JobResult((first, later), clock="launcher-host"))
    assert lines[0] == "job failed: rank 3 on host b failed first: exit code 1"
    assert any("ordered on the clock of launcher-host" in ln for ln in lines)


class _TwoChannelHandle:
    """A job handle of two channels whose events a test queues by hand."""

    def __init__(self) -> None:
        self.events: queue.Queue = queue.Queue()
        self.channels = [object(), object()]
        self.last_seen = [0.0, 0.0]

    def stop(self, interrupt: bool = False) -> None: ...
    def close(self) -> None: ...
    def kill(self) -> None: ...
    def send_all(self, obj, only=None) -> None: ...


def test_supervisor_orders_failures_by_when_the_launcher_learned_of_them():
    h = _TwoChannelHandle()
    h.events.put((1, _exit(0, wall=991.0, recv=51.0, age=0.1)))
    h.events.put((0, _exit(3, wall=1000.0, recv=50.0, age=0.2)))
    for i in (0, 1):
        h.events.put((i, {"ev": "done", "killed": 0}))
        h.events.put((i, {"ev": "eof"}))
    result = Supervisor(h, ["b", "a"], lambda *a: None, 1.0).run()  # type: ignore[arg-type]
    assert result.root_cause is not None and result.root_cause.host == "b"


def test_supervisor_keeps_early_exits_that_come_before_the_stop():
    """A rank's exit 0 before anything failed is kept (it may explain the
    stop signal that follows: report.py); exits 0 of the teardown are not."""
    h = _TwoChannelHandle()
    ok = {"ev": "exit", "rank": 1, "code": 0, "signal": None, "time": 1.0, "age": 0.0}
    h.events.put((1, ok | {"_recv": 10.0}))
    h.events.put((0, {"ev": "signal", "signal": 15, "time": 1.1, "age": 0.0, "_recv": 10.1}))
    h.events.put((0, ok | {"rank": 0, "_recv": 10.2}))  # handled SIGTERM, exited 0
    for i in (0, 1):
        h.events.put((i, {"ev": "done", "killed": 0}))
        h.events.put((i, {"ev": "eof"}))
    result = Supervisor(h, ["vm", "vm"], lambda *a: None, 1.0).run()  # type: ignore[arg-type]
    assert [e.rank for e in result.early_exits] == [1]
    assert result.root_cause is result.early_exits[0] and result.exit_code == 1


def test_straggler_lines_at_growing_intervals():
    ranks = {r: RankState("h1" if r < 2 else "h2", 100 + r, 0.0) for r in range(12)}
    s = Stragglers(30.0, " (hint)")
    assert s.line(1000.0, ranks) is None  # nobody exited yet
    ranks[0].ended = 10.0
    s.exited(10.0)
    assert s.line(39.9, ranks) is None
    line = s.line(40.0, ranks)
    assert line is not None and line.startswith("1 of 12 rank(s) finished 30s ago; still "
                                                 "running: rank 1 on h1 (running 40s)")
    assert "rank 8 on h2" in line and "rank 9" not in line and line.endswith(
        " and 3 more (hint)")
    assert s.line(99.0, ranks) is None and s.line(100.0, ranks) is not None  # +60 s
    assert s.line(219.0, ranks) is None and s.line(220.0, ranks) is not None  # +120 s
    for state in ranks.values():
        state.ended = 1.0
    assert s.line(10_000.0, ranks) is None


def test_stack_collection_streams_lines_and_knows_who_is_missing():
    got: list[str] = []
    c = StackCollection(1, {0, 1}, deadline=10.0, write=got.append)
    c.answer("h1", 0, 'Thread 1:\n  File "t.py", line 3 in f\n')
    c.answer("h1", 1, None)
    c.ended([0])
    assert not c.complete(5.0) and c.complete(10.0)
    c.ended([1])
    assert c.complete(0.0)
    assert got[:2] == ["[h1:0] Thread 1:", '[h1:0]   File "t.py", line 3 in f']
    assert "no Python stack" in got[2]
    assert "did not write its stack" in stack_lines("h", 2, "")[0]


class Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_on_a_terminal_is_one_line_updated_in_place():
    out, err = io.StringIO(), Tty()
    c = Console(out, err)
    assert c.tty
    c.start_progress(3, 6)
    for host in ("a", "b", "c"):
        c.connected(host)
    c.line("a", 0, 1, "hello")  # rank output: the progress line steps aside
    c.started(4)
    c.started(6)
    text = err.getvalue()
    assert "\r\x1b[Kdsrun: connected 3/3 hosts, 0/6 ranks started" in text
    assert "\r\x1b[Kdsrun: connected 3/3 hosts, 4/6 ranks started" in text
    assert text.count("\n") == 1 and text.endswith("6/6 ranks started in 0.0s\n")
    assert out.getvalue() == "[a:0] hello\n"
    c.connected("late")  # after the end: nothing more
    assert err.getvalue() == text


def test_progress_in_a_log_is_plain_lines():
    err = io.StringIO()
    c = Console(io.StringIO(), err)
    assert not c.tty
    c.start_progress(32, 64)
    for i in range(32):
        c.connected(f"h{i}")
    for n in range(1, 65):
        c.started(n)
    lines = err.getvalue().splitlines()
    assert "\r" not in err.getvalue()
    assert lines == ["dsrun: connected 0/32 hosts, 0/64 ranks started",
                     "dsrun: connected 32/32 hosts, 0/64 ranks started",
                     "dsrun: connected 32/32 hosts, 64/64 ranks started in 0.0s"]


def test_dead_code_is_gone():
    assert "on_start" not in inspect.signature(Supervisor.__init__).parameters
    assert "payloads" not in inspect.signature(JobHandle.__init__).parameters
    assert "stopped_ranks" not in {f.name for f in dataclasses.fields(JobResult)}
    assert '"fatal"' not in inspect.getsource(protocol) and "fatal " not in \
        inspect.getsource(protocol)
    assert "straggler_interval" in {f.name for f in dataclasses.fields(Watch)}


class _Gone:
    def wait(self, timeout=None) -> None:
        return None

    def exit_signal(self) -> None:
        return None


class _RecordingHandle:
    """A job handle that records what the supervisor sends; agents answer
    ``done`` only to a kill, as agents whose ranks ignore SIGTERM do."""

    def __init__(self, hosts: int, answer_kill: bool = True) -> None:
        self.events: queue.Queue = queue.Queue()
        self.channels = [_Gone() for _ in range(hosts)]
        self.last_seen = [0.0] * hosts
        self.sent: list[tuple[int, str]] = []
        self.killed = False
        self.answer_kill = answer_kill

    def stop(self, interrupt: bool = False) -> None:
        self.send_all({"cmd": "stop", "signal": "SIGINT"} if interrupt else {"cmd": "stop"})

    def send_all(self, obj, only=None) -> None:
        for i in range(len(self.channels)) if only is None else only:
            self.sent.append((i, obj["cmd"]))
            if obj["cmd"] == "kill" and self.answer_kill:
                self.events.put((i, {"ev": "done", "killed": 1}))
                self.events.put((i, {"ev": "eof"}))

    def kill(self) -> None:
        self.killed = True
        for i in range(len(self.channels)):
            self.events.put((i, {"ev": "eof"}))

    def close(self) -> None: ...
    def exit_message(self, index, code) -> str: return "gone"


def _interrupted_twice(h: _RecordingHandle) -> Supervisor:
    from dsrun.launcher.supervisor import SignalLatch

    latch = SignalLatch()
    latch(2, None)  # held (a supervised job): recorded, not raised
    latch(2, None)
    assert latch.pending == [2, 2]
    return Supervisor(h, ["a", "b"], lambda *a: None, 30.0,  # type: ignore[arg-type]
                      signals=latch)


def test_a_second_signal_tells_every_agent_to_kill_its_ranks_now():
    h = _RecordingHandle(2)
    for i in range(2):
        h.events.put((i, {"ev": "started", "rank": i, "pid": 100 + i}))
    result = _interrupted_twice(h).run()
    assert sorted(h.sent) == [(0, "kill"), (0, "stop"), (1, "kill"), (1, "stop")]
    assert not h.killed and result.unconfirmed == ()
    from dsrun.launcher.launch import stopped_line
    assert stopped_line(result) == "stopped by SIGINT; every rank was stopped"
    # a signal before supervision (connects, preflight, the ranks' start) says so
    assert stopped_line(JobResult(interrupted=signal.SIGINT, starting=True)) == (
        "stopped by SIGINT while the job was starting; every rank was stopped")


class _SignalledWhileStopping(_RecordingHandle):
    """A second Ctrl-C arrives while the stop is being sent to the agents."""

    def __init__(self, latch, times: int = 1) -> None:
        super().__init__(2)
        self.latch = latch
        self.times = times

    def send_all(self, obj, only=None) -> None:
        if obj["cmd"] == "stop":
            for _ in range(self.times):  # the handler runs in the middle of the write
                self.latch(signal.SIGINT, None)
        super().send_all(obj, only)


def test_a_signal_while_the_job_is_being_stopped_cannot_escape():
    from dsrun.launcher.supervisor import SignalLatch

    latch = SignalLatch()
    latch(signal.SIGTERM, None)
    h = _SignalledWhileStopping(latch)
    result = Supervisor(h, ["a", "b"], lambda *a: None, 30.0,  # type: ignore[arg-type]
                        signals=latch).run()
    assert result.interrupted == signal.SIGTERM  # the first signal is the cause
    assert sorted(h.sent) == [(0, "kill"), (0, "stop"), (1, "kill"), (1, "stop")]


def test_signals_while_a_failure_stops_the_job_keep_the_cause_and_the_second_hurries():
    """Ctrl-C twice while dsrun waits out the grace after a rank failed: the
    first leaves the ranks their grace, the second kills them at once; the
    failure stays the cause and the exit code."""
    import time

    from dsrun.launcher.supervisor import SignalLatch

    latch = SignalLatch()
    said: list[str] = []
    h = _SignalledWhileStopping(latch, times=2)
    h.events.put((1, _exit(1, time.time(), time.monotonic(), 0.0) | {"code": 4}))
    result = Supervisor(h, ["a", "b"], lambda *a: None, 30.0,  # type: ignore[arg-type]
                        watch=Watch(say=said.append), signals=latch).run()
    assert result.interrupted is None and result.exit_code == 4
    assert sorted(h.sent) == [(0, "kill"), (0, "stop"), (1, "kill"), (1, "stop")]
    # a failure's stop: the grace is agent_stop.FAILURE_GRACE, not --kill_grace 30
    assert said == ["SIGINT while the job is being stopped: the ranks still get 5s (a "
                    "failure's stop: --kill_grace, at most 5s); Ctrl-C again kills them now"]
    # and --max_restarts does not start another attempt after it
    from dsrun.launcher.launch import JobClock, _no_restart
    from dsrun.launcher.spec import LaunchSpec

    spec = LaunchSpec(script="x.py", max_restarts=3)
    assert _no_restart(spec, result, JobClock()) == "not restarting: stopped by SIGINT"


def test_the_latch_raises_only_while_a_job_starts():
    import pytest

    from dsrun.launcher.supervisor import Interrupted, SignalLatch

    latch = SignalLatch()
    latch(signal.SIGHUP, None)  # before the start: kept
    with pytest.raises(Interrupted) as first:
        latch.arm()
    assert first.value.signum == signal.SIGHUP and latch.pending == []
    latch.arm()
    with pytest.raises(Interrupted):
        latch(signal.SIGINT, None)
    latch(signal.SIGINT, None)  # a second one while the start is undone: recorded only
    assert latch.take() == [signal.SIGINT] and latch.take() == []
    latch.arm()
    latch.hold()
    latch(signal.SIGTERM, None)
    assert latch.pending == [signal.SIGTERM]


def test_agents_that_do_not_confirm_a_kill_are_named_not_claimed_stopped(monkeypatch):
    from dsrun.launcher import supervisor
    from dsrun.launcher.launch import stopped_line

    monkeypatch.setattr(supervisor, "KILL_WAIT", 0.3)
    h = _RecordingHandle(2, answer_kill=False)
    result = _interrupted_twice(h).run()
    assert h.killed and [u.host for u in result.unconfirmed] == ["a", "b"]
    line = stopped_line(result)
    assert "every rank was stopped" not in line
    assert "could not confirm the stop of the ranks on host a; the ranks on host b" in line


class _OneSilentHandle(_RecordingHandle):
    """Host 0 answers stack requests and stops; host 1's link is down."""

    def __init__(self) -> None:
        super().__init__(2)
        self.dropped: list[int] = []

    def send_all(self, obj, only=None) -> None:
        import time

        for i in range(2) if only is None else only:
            self.sent.append((i, obj["cmd"]))
            if i == 1:
                continue
            self.last_seen[0] = time.monotonic() + 1
            if obj["cmd"] == "stack":
                self.events.put((0, {"ev": "stack", "req": obj["req"], "rank": 0,
                                     "text": "  File \"t.py\", line 1\n"}))
                self.events.put((0, {"ev": "stack_end", "req": obj["req"]}))
            elif obj["cmd"] == "stop":
                self.events.put((0, {"ev": "done", "killed": 0}))
                self.events.put((0, {"ev": "eof"}))

    def drop(self, index: int) -> None:
        self.dropped.append(index)
        self.events.put((index, {"ev": "eof"}))


def test_a_timeout_does_not_wait_for_a_host_that_cannot_answer(monkeypatch):
    """--timeout with a host whose link is down (heartbeats off): exit 124
    came ~20 s later and the report silently lacked that host's stacks."""
    import time

    from dsrun.launcher import supervisor

    monkeypatch.setattr(supervisor, "TIMEOUT_STACK_WAIT", 0.5)
    h = _OneSilentHandle()
    h.events.put((0, {"ev": "started", "rank": 0, "pid": 10}))
    h.events.put((1, {"ev": "started", "rank": 1, "pid": 11}))
    start = time.monotonic()
    result = Supervisor(h, ["a", "b"], lambda *a: None, 30.0,  # type: ignore[arg-type]
                        Watch(timeout=0.2)).run()
    assert time.monotonic() - start < 10  # ~0.7 s; the bug waited the 30 s grace for b
    assert result.exit_code == 124 and h.dropped == [1]
    assert result.no_stacks == ("b",) and [u.host for u in result.unconfirmed] == ["b"]
    text = "\n".join(report_lines(result))
    assert "[a:0]" in text and "no stacks from b" in text
    assert "rank 1 on host b could not be confirmed stopped" in text


def test_a_failed_attempt_says_what_the_rank_reported_and_whether_it_restarts():
    import time

    from dsrun.launcher import launch
    from dsrun.launcher.spec import LaunchSpec

    ck = {"exc_type": "CheckpointError", "message": "CheckpointError: no checkpoint 'x' in ck",
          "traceback": ""}
    failure = RankFailure(host="vm", rank=1, code=1, signal=None, time=1.0, error=ck)
    result = JobResult((failure,))
    assert launch.attempt_line(result, 0, "restarting (1/2)") == (
        "attempt 1 failed (exit code 1 on rank 1): CheckpointError: no checkpoint 'x' in ck; "
        "restarting (1/2)")
    spec = dataclasses.replace(LaunchSpec(script="t.py"), max_restarts=2, timeout=10.0)
    clock = launch.JobClock()
    assert launch._no_restart(spec, result, clock) is None  # not started: nothing spent
    clock.started = time.monotonic() - 11.0
    assert "--timeout of 10s has passed" in str(launch._no_restart(spec, result, clock))
    config = {"exc_type": "DsrunConfigError", "message": "DsrunConfigError: bad"}
    bad = JobResult((dataclasses.replace(failure, error=config),))
    assert "recurs on every attempt" in str(launch._no_restart(spec, bad, launch.JobClock()))


def test_an_attempt_line_after_an_early_exit_keeps_the_failing_ranks_message():
    """the early exit is named, and so is the rank that then
    failed, with its message (this line is the terminal's only copy of it)."""
    from dsrun.errors import RANK_LOST
    from dsrun.launcher import launch

    lost = {"exc_type": "CheckpointError",
            "message": f"CheckpointError: x: {RANK_LOST} during the save exchange"}
    failed = RankFailure.from_event("vm", {"rank": 0, "code": 1, "_recv": 11.0, "error": lost})
    early = RankFailure.from_event("vm", {"rank": 1, "code": 0, "_recv": 10.0})
    result = JobResult((failed,), early_exits=(early,))
    assert result.root_cause is early
    assert launch.attempt_line(result, 0, "restarting (1/2)") == (
        "attempt 1 failed (rank 1 exited with status 0 early, the likely cause; then exit code "
        f"1 on rank 0): CheckpointError: x: {RANK_LOST} during the save exchange; "
        "restarting (1/2)")


def test_the_timeout_counts_from_the_jobs_start_not_the_attempts():
    import time

    class Handle:
        def __init__(self) -> None:
            self.events: queue.Queue = queue.Queue()
            self.channels = [object()]
            self.last_seen = [time.monotonic() + 60]
            self.stopped = False

        def stop(self, interrupt: bool = False) -> None:
            self.events.put((0, {"ev": "done", "killed": 0}))
            self.events.put((0, {"ev": "eof"}))

        def close(self) -> None: ...
        def kill(self) -> None: ...

        def send_all(self, obj, only=None) -> None:
            self.events.put((0, {"ev": "stack_end", "req": obj["req"]}))

    h = Handle()
    h.events.put((0, {"ev": "started", "rank": 0, "pid": 10}))
    begun = time.monotonic()
    watch = Watch(timeout=30.0, started=begun - 29.8)  # an earlier attempt spent 29.8 s
    result = Supervisor(h, ["a"], lambda *a: None, 1.0, watch).run()  # type: ignore[arg-type]
    # ~0.2 s left; a fresh --timeout per attempt would wait 30 s
    assert result.timed_out == 30.0 and time.monotonic() - begun < 10
