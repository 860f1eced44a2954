"""Who a stop signal is blamed on, and how long a stop waits (no processes
but the test's own): a rank without a handler killed by a signal sent to
the whole job before its agent's handler ran, the grace of a failure's stop
against a signal's, the ranks that failed of their own error during an
interrupted stop, and ``dsrun stack``'s word on a rank in a kernel wait."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

from dsrun import stackdump
from dsrun.launcher import agent_stop
from dsrun.launcher.agent_exits import JOB_WIDE, exit_event, stop_signal_of
from dsrun.launcher.agent_output import Rank
from dsrun.launcher.agent_stop import FAILURE_GRACE, JobProcesses
from dsrun.launcher.report import (
    JOB_WIDE_WINDOW,
    RankFailure,
    interruption,
)
from dsrun.launcher.stop_failures import own_failure_lines

TERM, INT = int(signal.SIGTERM), int(signal.SIGINT)


def _rank(seen: float, code: int | None = None, sig: int | None = None, rank: int = 0,
          host: str = "a", during_stop: bool = False, error: dict | None = None) -> RankFailure:
    return RankFailure(host=host, rank=rank, code=code, signal=sig, time=0.0, seen=seen,
                       during_stop=during_stop, error=error)


def _agent(seen: float, sig: int = TERM, host: str = "a",
           during_stop: bool = False) -> RankFailure:
    return RankFailure.from_signal_event(host, {"signal": sig, "_recv": seen, "age": 0.0,
                                                "during_stop": during_stop})


def test_a_rank_killed_before_its_agent_s_handler_ran_is_counted_with_the_agent_s_signal():
    """dsrun got nothing; the rank died of SIGTERM first (its exit reported
    before the agent's ``signal`` event, which then came during the stop):
    one signal to the whole job, on this host or another, not a failure."""
    killed = _rank(10.0, sig=TERM)
    for agent in (_agent(10.01, during_stop=True), _agent(10.3, host="b"),
                  _agent(9.9, during_stop=True)):
        assert interruption([killed, agent], [], None, None) == TERM
    handled = _rank(10.0, code=128 + TERM)  # a handler that exits 128+N
    assert interruption([handled, _agent(10.5, during_stop=True)], [], None, None) == TERM
    # another signal, a failure of its own, or too far apart: the rank is the cause
    assert interruption([killed, _agent(10.1, sig=INT, during_stop=True)], [], None,
                        None) is None
    assert interruption([_rank(10.0, code=1), _agent(10.1, during_stop=True)], [], None,
                        None) is None
    late = _agent(10.0 + JOB_WIDE_WINDOW + 1, during_stop=True)
    assert interruption([killed, late], [], None, None) is None


def _ended(status: int, ago: float) -> Rank:
    popen = subprocess.Popen([sys.executable, "-c", "pass"])
    popen.wait()
    rank = Rank(0, 0, popen, None, "/nonexistent", "/nonexistent")
    rank.status, rank.exit_mono = status, time.monotonic() - ago
    return rank


def test_the_agent_counts_a_rank_dead_of_its_own_signal_with_the_stop():
    """The rank died of SIGTERM 0.1 s before the agent's own SIGTERM was
    handled and the stop began: part of that stop, not a failure."""
    # The ranks first: starting their processes takes longer than 0.05 s on a
    # loaded machine, which put their exits after the stop's start.
    died = _ended(-TERM, ago=0.1)
    other = _ended(-int(signal.SIGKILL), ago=0.1)  # not of the agent's signal: its own
    old = _ended(-TERM, ago=JOB_WIDE + 1)  # long before: a signal of its own
    now = time.monotonic()
    stop_mono, signalled = now - 0.05, (TERM, now - 0.05)
    assert exit_event(died, None, True, stop_mono, signalled)["during_stop"] is True
    assert exit_event(died, None, True, stop_mono)["during_stop"] is False  # no signal known
    assert exit_event(other, None, True, stop_mono, signalled)["during_stop"] is False
    assert exit_event(old, None, True, stop_mono, signalled)["during_stop"] is False
    assert JOB_WIDE == JOB_WIDE_WINDOW
    assert [stop_signal_of(s) for s in (-TERM, 128 + INT, 1, -9)] == [TERM, INT, None, None]


def test_a_failure_s_stop_waits_failure_grace_a_signal_extends_it(monkeypatch):
    """Survivors of a failure are blocked in a collective with the dead rank:
    --kill_grace 30 would only delay the report and a restart; a signal's
    stop keeps it, and a signal during a failure's stop extends it."""
    monkeypatch.setattr(agent_stop.procs, "signal_job", lambda *a, **k: None)
    job = JobProcesses("m", 0.0, 30.0, None, None)
    job.begin([], signal.SIGTERM, failure=True)
    assert job.deadline - job.stop_mono == FAILURE_GRACE
    job.begin([], signal.SIGTERM)  # the agent's own SIGTERM: the whole grace
    assert job.deadline - job.stop_mono == 30.0
    signalled = JobProcesses("m", 0.0, 30.0, None, None)
    signalled.begin([], signal.SIGINT)
    assert signalled.deadline - signalled.stop_mono == 30.0
    short = JobProcesses("m", 0.0, 2.0, None, None)  # a shorter --kill_grace stands
    short.begin([], signal.SIGTERM, failure=True)
    assert short.deadline - short.stop_mono == 2.0
    rushed = JobProcesses("m", 0.0, 30.0, None, None)
    rushed.begin([], signal.SIGTERM, failure=True)
    rushed.hurry()
    rushed.begin([], signal.SIGTERM)  # hurried: never extended again
    assert rushed.deadline <= time.monotonic()


def test_a_rank_that_failed_of_its_own_error_during_an_interrupted_stop_is_named():
    """The preemption save raised: the summary says so (it used to say only
    "stopped by SIGTERM; every rank was stopped")."""
    save = {"exc_type": "CheckpointError", "message": "disk full",
            "traceback": "Traceback (most recent call last):\nCheckpointError: disk full\n"}
    failures = [_rank(1.0, code=1, rank=1, during_stop=True, error=save),
                _rank(1.0, sig=TERM, rank=0, during_stop=True),  # died of the signal
                _rank(1.0, code=130, rank=2, during_stop=True,
                      error={"exc_type": "KeyboardInterrupt", "message": ""}),
                _agent(0.9)]
    assert own_failure_lines(failures, TERM)[0] == \
        "rank 1 on host a failed during the stop (exit code 1): CheckpointError: disk full"
    assert len(own_failure_lines(failures, TERM)) == 2  # that rank, then the count


def test_the_supervisor_names_a_failure_during_a_stop_dsrun_s_signal_began():
    import queue

    from dsrun.launcher.supervisor import SignalLatch, Supervisor, Watch

    class Handle:
        def __init__(self) -> None:
            self.events: queue.Queue = queue.Queue()
            self.channels = [None]
            self.last_seen = [0.0]

        def stop(self, interrupt: bool = False) -> None:
            self.events.put((0, {"ev": "exit", "rank": 0, "code": 1, "signal": None,
                                 "time": 0.0, "age": 0.0, "during_stop": True,
                                 "_recv": time.monotonic(),
                                 "error": {"exc_type": "OSError", "message": "No space"}}))
            self.events.put((0, {"ev": "done", "killed": 0}))
            self.events.put((0, {"ev": "eof"}))

        def send_all(self, obj, only=None) -> None: ...
        def close(self) -> None: ...

    latch = SignalLatch()
    latch(TERM, None)
    said: list[str] = []
    result = Supervisor(Handle(), ["a"], lambda *a: None, 30.0,  # type: ignore[arg-type]
                        watch=Watch(say=said.append), signals=latch).run()
    assert result.interrupted == TERM
    assert "rank 0 on host a failed during the stop (exit code 1): No space" in said


def test_dsrun_stack_names_a_rank_in_a_kernel_wait():
    """A rank in uninterruptible sleep (D: an NFS read, a driver call)
    cannot run the handler: it is said so, not blamed on a handler."""
    assert "uninterruptible sleep" in stackdump.silent(3, state="D")
    assert "stopped" in stackdump.silent(3, state="T")
    assert "handler of the script's own" in stackdump.silent(3, state="S")
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        time.sleep(0.3)
        assert stackdump.proc_state(sleeper.pid) == "S"
        sleeper.send_signal(signal.SIGSTOP)
        time.sleep(0.2)
        assert stackdump.proc_state(sleeper.pid) == "T"
    finally:
        sleeper.kill()
        sleeper.wait()
    assert stackdump.proc_state(sleeper.pid) is None  # gone
