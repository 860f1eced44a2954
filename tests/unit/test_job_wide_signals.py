"""Signals to the whole job and SIGUSR1/2, without processes: when a stop
is an interruption rather than a failure (report.interruption), what the
supervisor does with a signal to an agent followed by its own, and when an
agent forwards SIGUSR1/2 (agent_forward.Forwarder)."""

from __future__ import annotations

import queue
import signal

from dsrun.launcher.agent_forward import MERGE, Forwarder
from dsrun.launcher.latch import MERGE as LATCH_MERGE
from dsrun.launcher.report import JOB_WIDE_WINDOW, RankFailure, interruption
from dsrun.launcher.supervisor import Forwards, SignalLatch, Supervisor, Watch

TERM, INT = int(signal.SIGTERM), int(signal.SIGINT)


def _rank(seen: float, code: int | None = None, sig: int | None = None,
          rank: int = 0) -> RankFailure:
    return RankFailure(host="a", rank=rank, code=code, signal=sig, time=0.0, seen=seen)


def _agent(seen: float, sig: int = TERM) -> RankFailure:
    return RankFailure.from_signal_event("a", {"signal": sig, "_recv": seen, "age": 0.0})


def test_a_signal_to_an_agent_is_an_interruption_unless_an_early_exit_explains_it():
    assert interruption([_agent(10.0)], [], None, None) == TERM
    early = _rank(9.0, code=0, rank=1)  # mpirun's orted signals the agents after it
    assert interruption([_agent(10.0)], [early], None, None) is None


def test_a_rank_ending_of_dsrun_s_own_signal_close_to_it_is_one_job_wide_signal():
    killed, handled = _rank(10.0, sig=TERM), _rank(10.0, code=128 + INT)  # KeyboardInterrupt
    assert interruption([killed], [], TERM, 10.5) == TERM
    assert interruption([handled], [], INT, 9.5) == INT
    # another signal, a failure of its own, or too far apart: the failure stays the cause
    assert interruption([killed], [], INT, 10.5) is None
    assert interruption([_rank(10.0, code=1)], [], TERM, 10.5) is None
    assert interruption([killed], [], TERM, 10.0 + JOB_WIDE_WINDOW + 1) is None
    assert interruption([killed], [], None, None) is None


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class _Handle:
    """Agents that confirm a stop or a kill at once; what was sent.
    ``on_stop``: runs when the stop goes out (dsrun's own signal arriving
    after the agent's ``signal`` event began the stop)."""

    def __init__(self, events: list[dict], on_stop=lambda: None) -> None:
        self.events: queue.Queue = queue.Queue()
        self.channels = [None]
        self.last_seen = [0.0]
        self.watched: list[int] = []
        self.sent: list[dict] = []
        self.on_stop = on_stop
        for event in events:
            self.events.put((0, event))

    def stop(self, interrupt: bool = False) -> None:
        self.send_all({"cmd": "stop"})

    def send_all(self, obj, only=None) -> None:
        self.sent.append(obj)
        if obj["cmd"] == "stop":
            self.on_stop()
        if obj["cmd"] in ("stop", "kill"):
            self.events.put((0, {"ev": "done", "killed": 0}))
            self.events.put((0, {"ev": "eof"}))

    def close(self) -> None: ...
    def exit_message(self, index, code) -> str: return "gone"


def _agent_event() -> dict:
    import time

    return {"ev": "signal", "signal": TERM, "time": time.time(), "age": 0.0,
            "_recv": time.monotonic()}


def test_dsrun_s_own_signal_joins_an_agent_s_stop_and_only_a_second_one_kills():
    """The agent's ``signal`` event begins the stop; dsrun's own copy comes
    after it (the latch fires when the stop goes out), so the supervisor's
    "join the stop under way" branch runs: it marks the signal ``hurried``,
    never ``interrupted`` (the branch of a fresh stop)."""
    for own, kills in ((1, False), (2, True)):
        clock = _Clock()
        latch = SignalLatch(clock)

        def fire(latch=latch, clock=clock, own=own) -> None:
            for _ in range(own):
                latch(TERM, None)
                clock.now += 2 * LATCH_MERGE  # a second signal, not a copy of the first

        h = _Handle([_agent_event()], on_stop=fire)
        said: list[str] = []
        sup = Supervisor(h, ["a"], lambda *a: None, 30.0,  # type: ignore[arg-type]
                         watch=Watch(say=said.append), signals=latch)
        result = sup.run()
        assert sup.state.own == TERM and sup.state.own_count == own
        assert sup.state.interrupted is None and sup.state.hurried == TERM  # joined
        assert result.exit_code == 128 + TERM and result.interrupted == TERM
        assert all(f.during_stop for f in result.failures)  # no "job failed" report
        assert ({"cmd": "kill"} in h.sent) is kills
        assert not any("being stopped" in line for line in said), said


def test_two_copies_of_one_signal_to_dsrun_are_one_delivery_a_third_kills():
    """Slurm's SIGTERM and a batch script's ``trap`` passing it on reach dsrun
    milliseconds apart: one stop, the ranks keep their grace; Ctrl-C pressed
    again after LATCH_MERGE, or a burst, still kills at once."""
    for gaps, kills in (((0.01,), False), ((2 * LATCH_MERGE,), True), ((0.01, 0.01), True)):
        clock = _Clock()
        latch = SignalLatch(clock)
        latch(TERM, None)
        for gap in gaps:
            clock.now += gap
            latch(TERM, None)
        h = _Handle([])
        said: list[str] = []
        result = Supervisor(h, ["a"], lambda *a: None, 30.0,  # type: ignore[arg-type]
                            watch=Watch(say=said.append), signals=latch).run()
        assert result.interrupted == TERM
        assert ({"cmd": "kill"} in h.sent) is kills, (gaps, h.sent)
        assert said[0] == ("SIGTERM: stopping the job; the ranks get --kill_grace 30s to end "
                           "(a handler's save), then are killed; a second signal kills them now")


def test_an_agent_signalled_alone_is_named():
    import time

    h = _Handle([{"ev": "signal", "signal": TERM, "time": time.time(), "age": 0.0,
                  "_recv": time.monotonic()}])
    said: list[str] = []
    result = Supervisor(h, ["a"], lambda *a: None, 30.0,  # type: ignore[arg-type]
                        watch=Watch(say=said.append), signals=SignalLatch()).run()
    assert result.interrupted == TERM
    assert said == ["the node agent on host a got SIGTERM (not from dsrun, which got none): "
                    "it stopped its ranks, and dsrun stopped the job"]


def test_sigusr1_to_dsrun_is_sent_to_every_agent_and_never_stops_the_job():
    forwards = Forwards()
    forwards(signal.SIGUSR1, None)  # while the job was starting: dropped
    h = _Handle([])
    said: list[str] = []
    sup = Supervisor(h, ["a"], lambda *a: None, 30.0,  # type: ignore[arg-type]
                     watch=Watch(say=said.append), signals=SignalLatch(), forwards=forwards)
    forwards(signal.SIGUSR2, None)
    sup._step()
    assert h.sent == [{"cmd": "signal", "signal": "SIGUSR2"}] and not sup.state.stopping
    assert said == ["SIGUSR1 while the job was starting: not forwarded",
                    "SIGUSR2: forwarded to every rank's process group"]


def test_the_agent_forwards_each_delivery_once():
    clock, sent = _Clock(), []
    fwd = Forwarder(sent.append, clock)
    usr1 = int(signal.SIGUSR1)
    fwd.note(usr1, launcher=True)  # dsrun alone got it: forwarded at once
    assert sent == [usr1]
    clock.now += 0.1
    fwd.note(usr1, launcher=False)  # and the agent's own copy of it: not again
    clock.now += 2 * MERGE
    fwd.settle()
    assert sent == [usr1]
    fwd.note(usr1, launcher=False)  # the whole job got it: the ranks have it
    clock.now += 0.1
    fwd.note(usr1, launcher=True)
    clock.now += 2 * MERGE
    fwd.settle()
    assert sent == [usr1]
    fwd.note(usr1, launcher=False)  # the agent alone (srun passing it on): forwarded
    fwd.settle()
    assert sent == [usr1]  # not before MERGE: dsrun's command may follow
    clock.now += 2 * MERGE
    fwd.settle()
    assert sent == [usr1, usr1]
