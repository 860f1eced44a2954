"""What dsrun says it knows at the end of a stop (explore22-mpisig findings
2, 3 and 5), without processes: a scripted job handle feeds the supervisor.

- An agent whose connection ends before its ``done`` while a signal stops
  the job (killed by mpirun or srun, or by hand) leaves its ranks
  unconfirmed: the last line used to say "every rank was stopped".
- A rank that failed of its own during the stop makes the last line say so.
- srun, signalled itself, SIGKILLs its whole step ("forcing job
  termination"): an interruption (143, no restart), not a node-agent failure.
- One silent agent among several on a host (one agent per rank) is that
  agent, with its rank, not the whole host with every rank.
"""

from __future__ import annotations

import queue
import signal
import time
from types import SimpleNamespace

from dsrun.launcher.launch import restarts_line
from dsrun.launcher.report import JobResult, RankFailure, report_lines, unconfirmed_lines
from dsrun.launcher.spec import LaunchSpec
from dsrun.launcher.stop_failures import stopped_line
from dsrun.launcher.supervisor import SignalLatch, Supervisor, Watch

FORCED = "srun: forcing job termination"


class _Channel:
    def wait(self, timeout: float | None = None) -> int | None:
        return 0

    def exit_signal(self) -> int | None:
        return None


class _Handle:
    """Agents 0..n-1, one rank each; on ``stop`` each agent in ``confirm``
    reports its rank's exit and ``done``, the others' connections end."""

    def __init__(self, agents: int, confirm: set[int], forced: str | None = None) -> None:
        self.events: queue.Queue = queue.Queue()
        self.channels = [_Channel() for _ in range(agents)]
        self.last_seen = [time.monotonic() + 3600] * agents
        self.watched = list(range(agents))
        self.confirm = confirm
        self.dropped: list[int] = []
        self.tool = SimpleNamespace(output=SimpleNamespace(forced=forced))
        for i in range(agents):
            self.events.put((i, {"ev": "started", "rank": i, "pid": 100 + i}))

    def stop(self, interrupt: bool = False) -> None:
        self.send_all({"cmd": "stop"})

    def send_all(self, obj, only=None) -> None:
        if obj["cmd"] != "stop":
            return
        for i in range(len(self.channels)) if only is None else only:
            if i in self.confirm:
                self.events.put((i, {"ev": "exit", "rank": i, "code": 0, "signal": None,
                                     "during_stop": True}))
                self.events.put((i, {"ev": "done", "killed": 0}))
            self.events.put((i, {"ev": "eof"}))

    def drop(self, index: int) -> None:
        self.dropped.append(index)

    def kill(self) -> None: ...
    def close(self) -> None: ...

    def exit_message(self, index: int, code: int | None) -> str:
        return f"lost the connection to the agent of rank {index} on vm"


def _sigterm() -> SignalLatch:
    latch = SignalLatch()
    latch(signal.SIGTERM, None)  # held (a supervised job): recorded
    return latch


def test_an_agent_that_ends_before_confirming_its_ranks_stop_is_named():
    h = _Handle(2, confirm={0})
    result = Supervisor(h, ["vm", "vm"], lambda *a: None, 30.0,  # type: ignore[arg-type]
                        signals=_sigterm()).run()
    assert result.exit_code == 143
    assert [(u.host, u.ranks, u.ended) for u in result.unconfirmed] == [("vm", (1,), True)]
    line = stopped_line(result)
    assert "every rank was stopped" not in line, line
    assert line == ("stopped by SIGTERM; could not confirm the stop of rank 1 on host vm "
                    "(their agents did not confirm it: see above)")
    assert unconfirmed_lines(result) == [
        "rank 1 on host vm could not be confirmed stopped: the agent ended before confirming "
        "their stop (it was killed, or its connection dropped, and its ranks die with it): "
        "what they still did on the signal (a save) may not have completed"]


def test_every_agent_confirming_is_every_rank_stopped():
    h = _Handle(2, confirm={0, 1})
    result = Supervisor(h, ["vm", "vm"], lambda *a: None, 30.0,  # type: ignore[arg-type]
                        signals=_sigterm()).run()
    assert result.unconfirmed == ()
    assert stopped_line(result) == "stopped by SIGTERM; every rank was stopped"


def test_a_rank_that_failed_of_its_own_during_the_stop_is_counted_in_the_last_line():
    crash = RankFailure(host="vm", rank=1, code=None, signal=int(signal.SIGSEGV), time=0.0,
                        during_stop=True)
    term = RankFailure(host="vm", rank=0, code=None, signal=int(signal.SIGTERM), time=0.0,
                       during_stop=True)
    result = JobResult((crash, term), interrupted=int(signal.SIGTERM))
    assert stopped_line(result) == ("stopped by SIGTERM; every rank ended (1 of them failed "
                                    "of its own during the stop: above)")


def test_srun_killing_its_step_on_its_own_signal_is_an_interruption():
    said: list[str] = []
    h = _Handle(2, confirm=set(), forced=FORCED)
    h.events.put((0, {"ev": "eof"}))  # srun SIGKILLed the agents: no stop asked
    result = Supervisor(h, ["vm", "vm"], lambda *a: None, 30.0,  # type: ignore[arg-type]
                        Watch(say=said.append)).run()
    assert result.interrupted == signal.SIGTERM and result.exit_code == 143, said
    assert all(f.during_stop for f in result.failures)  # nothing to restart
    assert any("srun got a signal (not from dsrun, which got none) and SIGKILLed every "
               "task of its step" in line for line in said), said
    assert {u.forced for u in result.unconfirmed} == {True}
    assert unconfirmed_lines(result)[0].startswith(
        "rank 0, 1 on host vm killed with SIGKILL by srun, with every task of its step")
    assert stopped_line(result) == ("stopped by SIGTERM; rank 0, 1 on host vm killed with "
                                    "SIGKILL by srun (see above)")


def test_an_agent_lost_without_srun_s_line_is_still_a_failure():
    h = _Handle(2, confirm=set())
    h.events.put((0, {"ev": "eof"}))
    result = Supervisor(h, ["vm", "vm"], lambda *a: None, 30.0).run()  # type: ignore[arg-type]
    assert result.interrupted is None and result.exit_code == 1


def _silence(h: _Handle):
    """Once both ranks started, agent 1 has been silent for 10 s."""
    def started(count: int) -> None:
        if count == 2:
            h.last_seen[1] = time.monotonic() - 10
    return started


def test_one_silent_agent_of_several_on_a_host_is_named_by_its_rank():
    said: list[str] = []
    h = _Handle(2, confirm={0})
    result = Supervisor(h, ["vm", "vm"], lambda *a: None, 30.0,  # type: ignore[arg-type]
                        Watch(heartbeat_timeout=3.0, say=said.append,
                              on_started=_silence(h))).run()
    assert h.dropped == [1]
    assert said[0].startswith("the agent of rank 1 on host vm lost: nothing heard from it "
                              "for "), said
    lines = report_lines(result)
    assert lines[0].startswith("job failed: the agent of rank 1 on host vm was lost first: "
                               "nothing heard from it for "), lines
    assert "rank(s) 1 ran there" in lines[0] and "0,1" not in lines[0], lines
    assert [(u.host, u.ranks) for u in result.unconfirmed] == [("vm", (1,))]


def test_a_lost_host_with_one_agent_is_still_the_host():
    said: list[str] = []
    h = _Handle(2, confirm={0})
    result = Supervisor(h, ["a", "b"], lambda *a: None, 30.0,  # type: ignore[arg-type]
                        Watch(heartbeat_timeout=3.0, say=said.append,
                              on_started=_silence(h))).run()
    assert said[0].startswith("host b lost: nothing heard from it for "), said
    assert report_lines(result)[0].startswith("job failed: host b was lost first: ")


def test_the_end_of_a_job_says_how_many_restarts_it_took():
    spec = LaunchSpec(script="x.py", max_restarts=2)
    assert restarts_line(spec, JobResult(), 0) == ""
    assert restarts_line(spec, JobResult(), 1) == "job succeeded after 1 restart(s) (attempt 2)"
    failed = JobResult((RankFailure(host="a", rank=1, code=7, signal=None, time=0.0),))
    assert restarts_line(spec, failed, 2) == \
        "attempt 3 failed too: all 2 restart(s) used (--max_restarts 2)"
    assert restarts_line(spec, failed, 1) == ""  # stopped restarting for another reason
    assert restarts_line(spec, JobResult(interrupted=int(signal.SIGTERM)), 2) == ""
