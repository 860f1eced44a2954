"""The launcher's event loop over a running job.

It streams rank output to the console (pausing the agents' output while
the console is behind: a slow reader of dsrun's stdout then slows the
ranks, as a direct write would, and the launcher's memory stays bounded),
collects rank exits, and stops
every node when the first failure arrives (a rank's exit, or a node agent
saying it was signalled itself), when dsrun itself is signalled,
when ``--timeout`` expires, or when a host goes silent for longer than the
heartbeat timeout (it is then *lost*: its transport is dropped, since a
dead link stalls instead of closing, and the report names it). It ends
when every agent has said ``done`` (all its processes are gone) or has
disappeared. Agents that ignore a stop are killed after a deadline; their
guards then clean up what they left.

Meanwhile it says which ranks still run once others have exited
(watch.Stragglers), and answers stack requests (``dsrun stack`` through
the control socket, and the report of a ``--timeout``): every agent is
asked, and the answers are streamed back as ``[host:rank]`` lines.
"""

from __future__ import annotations

import queue
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from dsrun.launcher.agent_stop import FAILURE_GRACE
from dsrun.launcher.backends.base import JobHandle
from dsrun.launcher.control import StackQuery
from dsrun.launcher.latch import FORWARDS, SIGNALS, Forwards, Interrupted, SignalLatch
from dsrun.launcher.report import (
    JobResult,
    RankFailure,
    RunningRank,
    SigKilled,
    ended_of,
    interruption,
    root_cause,
    signal_name,
    signalled_agent,
)
from dsrun.launcher.stop_failures import own_failure_lines
from dsrun.launcher.supervisor_ends import forced_line, unconfirmed_agents
from dsrun.launcher.supervisor_stacks import QUERY_STACK_WAIT, StackRequests
from dsrun.launcher.watch import RankState, StackCollection, Stragglers

# SignalLatch, SIGNALS and Interrupted lived here; launch.py and tests import them from here.
__all__ = ["FORWARDS", "QUERY_STACK_WAIT", "SIGNALS", "Forwards", "Interrupted", "SignalLatch",
           "Supervisor", "Watch"]

# (host, rank, fd, lines) -> None: the lines of one ``out`` event
LinesSink = Callable[[str, int, int, list[str]], None]
#: Console backlog (bytes) above which the agents hold rank output, and
#: below which they send it again.
OUTPUT_HIGH = 2 * 1024 * 1024
OUTPUT_LOW = 256 * 1024

# Extra seconds an agent gets beyond the kill grace to report ``done``.
AGENT_SLACK = 10.0
#: Seconds agents get to send the stacks of a --timeout (``dsrun stack``:
#: supervisor_stacks.QUERY_STACK_WAIT).
TIMEOUT_STACK_WAIT = 5.0
#: Seconds agents get to confirm a kill (second signal) before their
#: transports are dropped.
KILL_WAIT = 3.0
#: The signals that stop a job (a rank killed by one was most likely sent it
#: with the rest of the job: its stop keeps the whole --kill_grace).
STOP_SIGNALS = frozenset({int(signal.SIGTERM), int(signal.SIGINT), int(signal.SIGHUP)})


@dataclass(frozen=True)
class Watch:
    """What the supervisor watches for, besides exits (all optional)."""

    timeout: float | None = None  # --timeout seconds
    # monotonic start of the --timeout (launch: the first attempt's); default: now
    started: float = field(default_factory=time.monotonic)
    heartbeat_timeout: float = 0.0  # 0: no liveness check
    straggler_interval: float | None = None  # None: no straggler lines
    queries: queue.Queue[StackQuery] | None = None  # dsrun stack requests
    say: Callable[[str], None] = lambda message: None
    job_id: str = ""  # named in straggler lines, for dsrun stack
    on_started: Callable[[int], None] = lambda count: None  # ranks started so far
    # bytes of output the console has still to write: above OUTPUT_HIGH the
    # agents hold their ranks' output until it is below OUTPUT_LOW (link.py)
    output_backlog: Callable[[], int] = lambda: 0


@dataclass
class _State:
    hosts: list[str]
    open_nodes: set[int]
    done: set[int] = field(default_factory=set)
    failures: list[RankFailure] = field(default_factory=list)
    early_exits: list[RankFailure] = field(default_factory=list)  # status 0, not stopping
    ranks: dict[int, RankState] = field(default_factory=dict)
    stopping: bool = False
    stop_grace: float = 0.0  # the grace the agents were given
    deadline: float = 0.0
    interrupted: int | None = None  # dsrun's own signal, which began the stop
    hurried: int | None = None  # dsrun's own signal while something else stopped the job
    own: int | None = None  # dsrun's first signal, and when (monotonic)
    own_seen: float | None = None
    own_count: int = 0  # dsrun's own stop signals: the second one kills at once
    killed: int = 0
    sigkilled: list[SigKilled] = field(default_factory=list)  # per agent's ``done``
    timed_out: float | None = None
    running_at_timeout: tuple[RunningRank, ...] = ()
    collections: dict[int, StackCollection] = field(default_factory=dict)
    timeout_stacks: StackCollection | None = None
    unconfirmed: set[int] = field(default_factory=set)  # given up on before ``done``
    # agents whose connection ended without ``done``: its ranks, and whether
    # the job was stopping then
    ended: dict[int, tuple[tuple[int, ...], bool]] = field(default_factory=dict)
    forced: str | None = None  # srun's FORCED line (supervisor_ends.forced_line)
    dropped: list[RankFailure] = field(default_factory=list)  # connections that ended
    # per agent: the ranks it said ``started`` and has not reported the exit of
    unreported: dict[int, set[int]] = field(default_factory=dict)
    agent_failed: set[int] = field(default_factory=set)  # agents that sent ``fail``
    no_stacks: set[int] = field(default_factory=set)  # silent when the --timeout asked
    timeout_asked: float = 0.0  # when the --timeout's stack request went out
    next_req: int = 1


class Supervisor(StackRequests):
    def __init__(self, handle: JobHandle, hosts: list[str], sink: LinesSink,
                 kill_grace: float, watch: Watch | None = None,
                 signals: SignalLatch = SIGNALS, forwards: Forwards = FORWARDS) -> None:
        self.handle = handle
        self.signals = signals
        self.forwards = forwards
        self.sink = sink
        self.output_paused = False
        self.grace = kill_grace
        self.watch = watch or Watch()
        self.state = _State(hosts=list(hosts), open_nodes=set(range(len(hosts))))
        for signum in forwards.take():  # no rank had its handler yet: it would die of it
            self.watch.say(f"{signal.Signals(signum).name} while the job was starting: "
                           f"not forwarded")
        hint = f" (dsrun stack {self.watch.job_id[:12]} shows their Python stacks)" \
            if self.watch.job_id else ""
        self.stragglers = Stragglers(self.watch.straggler_interval or 0.0, hint)

    def run(self) -> JobResult:
        st = self.state
        try:
            while st.open_nodes:
                self._step()
        finally:
            self.handle.close()
            for collection in list(st.collections.values()):
                self._finish_collection(collection)
        stacks = tuple(st.timeout_stacks.lines) if st.timeout_stacks is not None else ()
        interrupted, failures = self._outcome()
        unconfirmed = unconfirmed_agents(st.hosts, st.unconfirmed - st.done, st.unreported,
                                         st.ended, interrupted is not None, st.forced)
        return JobResult(failures, interrupted, st.killed,
                         timed_out=st.timed_out, running=st.running_at_timeout, stacks=stacks,
                         unconfirmed=unconfirmed,
                         no_stacks=tuple(st.hosts[i] for i in sorted(st.no_stacks)),
                         starting=not st.ranks, hurried=st.hurried,
                         early_exits=tuple(st.early_exits), sigkilled=tuple(st.sigkilled),
                         kill_grace=self.grace)

    def _stop(self, interrupt: bool = False, failure: bool = False) -> None:
        """Stop every agent's ranks; ``interrupt``: dsrun (or an agent) got a
        Ctrl-C, so they get SIGINT first (their KeyboardInterrupt handlers
        run), not SIGTERM; ``failure``: a failure began the stop, so they
        get agent_stop.FAILURE_GRACE at most (a signal's stop, or
        --timeout's, the whole --kill_grace)."""
        st = self.state
        if not st.stopping:
            st.stopping = True
            st.stop_grace = min(self.grace, FAILURE_GRACE) if failure else self.grace
            st.deadline = time.monotonic() + self.grace + AGENT_SLACK
            if failure:
                self.handle.send_all({"cmd": "stop", "failure": True})
            else:
                self.handle.stop(interrupt=interrupt)

    def _kill_now(self) -> None:
        """A second signal: every agent SIGKILLs its ranks at once; agents
        that do not confirm within KILL_WAIT lose their transport."""
        st = self.state
        self._stop()
        self.handle.send_all({"cmd": "kill"}, only=sorted(st.open_nodes - st.done))
        st.deadline = min(st.deadline, time.monotonic() + KILL_WAIT)

    def _outcome(self) -> tuple[int | None, tuple[RankFailure, ...]]:
        """The signal that stopped the job, if one did, and the failures.

        A stop signal to a node agent, or one to every process of the job
        (report.interruption), is an interruption like dsrun's own: the
        failures it caused are its consequences (during the stop), and
        the job is not restarted."""
        st = self.state
        st.forced = forced_line(self.handle)
        failures = tuple(st.failures)
        if st.interrupted is not None or st.timed_out is not None:
            self._failed_during_stop(failures, st.interrupted)
            return st.interrupted, failures
        signum = interruption(failures, st.early_exits, st.own, st.own_seen) or \
            self._forced_stop(failures)
        if signum is None:
            return None, failures
        agent = signalled_agent(failures, signum)
        if agent is not None and st.own is None:
            self.watch.say(f"the node agent on host {agent.host} got {signal_name(signum)} "
                           f"(not from dsrun, which got none): it stopped its ranks, and "
                           f"dsrun stopped the job")
        failures = tuple(replace(f, during_stop=True) for f in failures)
        self._failed_during_stop(failures, signum)
        return signum, failures

    def _forced_stop(self, failures: tuple[RankFailure, ...]) -> int | None:
        """SIGTERM when srun, signalled itself (not by dsrun, which got
        nothing), SIGKILLed every task of its step and that is what ended
        the job: the first failure is an agent's connection that ended. An
        interruption, as a signal to mpirun is (its agents get SIGTERM):
        128+N, no restart. srun does the same on SIGHUP and SIGQUIT, and its
        line does not say which: SIGTERM is what schedulers and admins send."""
        st = self.state
        cause = root_cause(failures, st.early_exits)
        if st.forced is None or cause is None or not any(cause is f for f in st.dropped):
            return None
        self.watch.say(f"srun got a signal (not from dsrun, which got none) and SIGKILLed "
                       f"every task of its step ({st.forced!r}): taken for SIGTERM (srun "
                       f"does the same on SIGHUP or SIGQUIT)")
        return int(signal.SIGTERM)

    def _failed_during_stop(self, failures: tuple[RankFailure, ...], signum: int | None) -> None:
        """Ranks that failed of their own (an error, a crash, a status of
        their own) while a signal stopped the job are named (stop_failures.py)."""
        if signum is not None:
            for line in own_failure_lines(failures, signum, self.state.sigkilled):
                self.watch.say(line)

    def _give_up(self) -> None:
        """The stop deadline passed: drop every agent that has not said
        ``done``; whether its ranks are gone is then not known here."""
        st = self.state
        st.unconfirmed |= st.open_nodes - st.done
        self.handle.kill()
        st.deadline = float("inf")

    def _signalled(self, signum: int) -> None:
        """A stop signal to dsrun itself. The first one stops the job, or
        joins the stop already under way (a signal to every process of the
        job reaches the agents and the ranks too, in any order): the ranks
        get their --kill_grace either way. Only a second one to dsrun
        itself kills every rank at once (a copy within latch.MERGE is none)."""
        st = self.state
        st.own_count += 1
        name = signal.Signals(signum).name
        if st.own is None:
            st.own, st.own_seen = signum, time.monotonic()
        if st.own_count > 1:  # no more patience
            if st.interrupted is None and st.hurried is None:
                st.hurried = signum
            self._kill_now()
            return
        again = "Ctrl-C again" if signum == signal.SIGINT else "a second signal"
        if st.stopping or st.timed_out is not None:
            # Something else is ending the job already (a failure, a lost host,
            # --timeout, a signal to an agent): it stays the cause unless it is
            # this very signal, sent to the whole job (_outcome); no restart.
            st.hurried = signum
            if interruption(st.failures, st.early_exits, signum, st.own_seen) != signum:
                grace = f"--kill_grace {self.grace:g}s" if st.stop_grace >= self.grace else \
                    f"{st.stop_grace:g}s (a failure's stop: --kill_grace, at most " \
                    f"{FAILURE_GRACE:g}s)"
                self.watch.say(f"{name} while the job is being stopped: the ranks still get "
                               f"{grace}; {again} kills them now")
            return
        st.interrupted = signum
        self.watch.say(f"{name}: stopping the job; the ranks get --kill_grace {self.grace:g}s "
                       f"to end (a handler's save), then are killed; {again} kills them now")
        self._stop(interrupt=signum == signal.SIGINT)

    def _forward(self, signum: int) -> None:
        """SIGUSR1/SIGUSR2 to dsrun: every agent passes it on to its ranks'
        process groups (agent.py); the job goes on."""
        st = self.state
        name = signal.Signals(signum).name
        if st.stopping:
            self.watch.say(f"{name} while the job is being stopped: not forwarded")
            return
        self.handle.send_all({"cmd": "signal", "signal": name},
                             only=sorted(st.open_nodes - st.done))
        self.watch.say(f"{name}: forwarded to every rank's process group")

    def _step(self) -> None:
        st = self.state
        for signum in self.signals.take():
            self._signalled(signum)
        for signum in self.forwards.take():
            self._forward(signum)
        try:
            index, msg = self.handle.events.get(timeout=0.2)
        except queue.Empty:
            pass
        else:
            self._handle(index, msg)
        now = time.monotonic()
        if st.stopping and now > st.deadline:
            self._give_up()
        self._pace_output()
        self._check_liveness(now)
        self._check_timeout(now)
        self._serve_queries(now)
        self._check_collections(now)
        if not st.stopping and self.watch.straggler_interval:
            line = self.stragglers.line(now, st.ranks, paused=self.output_paused)
            if line:
                self.watch.say(line)

    def _pace_output(self) -> None:
        """Hold the ranks' output while the console is behind (see Watch)."""
        backlog = self.watch.output_backlog()
        if not self.output_paused and backlog > OUTPUT_HIGH:
            self.output_paused = True
            self.handle.send_all({"cmd": "pause"})
        elif self.output_paused and backlog < OUTPUT_LOW:
            self.output_paused = False
            self.handle.send_all({"cmd": "resume"})

    # -- events ---------------------------------------------------------------
    def _handle(self, index: int, msg: dict[str, Any]) -> None:
        st = self.state
        ev = msg.get("ev")
        host = st.hosts[index]
        if ev == "out":
            lines = msg["lines"] if "lines" in msg else [msg["line"]]
            self.sink(host, msg["rank"], msg["fd"], lines)
        elif ev == "hello":
            st.hosts[index] = msg.get("host") or host
        elif ev == "started":
            st.ranks[int(msg["rank"])] = RankState(host, msg.get("pid"),
                                                   float(msg.get("_recv", time.monotonic())))
            st.unreported.setdefault(index, set()).add(int(msg["rank"]))
            self.watch.on_started(len(st.ranks))
        elif ev == "exit":
            self._exited(index, host, msg)
        elif ev == "fail":  # the agent itself failed (a --log_dir file, a crash)
            self._agent_failed(index, host, str(msg.get("message") or "node agent failed"),
                               float(msg.get("_recv", time.monotonic())))
        elif ev == "signal":  # the agent itself was signalled: it stops its ranks
            failure = RankFailure.from_signal_event(host, msg)
            st.failures.append(replace(failure, during_stop=failure.during_stop or st.stopping))
            self._stop(interrupt=failure.signal == signal.SIGINT)
        elif ev in ("stack", "stack_end"):
            self._stack_event(index, host, msg)
        elif ev == "done":
            self._done(index, host, msg)
        elif ev == "eof":
            self._ended(index, host)
        elif ev in ("garbage", "agent_err"):
            self.sink(host, -1, 2, [msg["line"]])

    def _done(self, index: int, host: str, msg: dict[str, Any]) -> None:
        """The agent's teardown is over: note the ranks it had to SIGKILL."""
        st = self.state
        st.done.add(index)
        st.killed += int(msg.get("killed", 0))
        ranks = tuple(int(r) for r in msg.get("sigkilled") or ())
        if ranks:
            st.sigkilled.append(SigKilled(host, ranks, str(msg.get("after") or "SIGTERM"),
                                          bool(msg.get("at_once")), bool(msg.get("short"))))

    def _exited(self, index: int, host: str, msg: dict[str, Any]) -> None:
        st = self.state
        rank = msg.get("rank")
        if rank is not None:
            st.unreported.get(index, set()).discard(int(rank))
        if rank is not None and int(rank) in st.ranks:
            st.ranks[int(rank)].ended = float(msg.get("_recv", time.monotonic()))
        self.stragglers.exited(time.monotonic())
        if msg.get("code") != 0:
            failure = RankFailure.from_event(host, msg)
            st.failures.append(failure)
            # A rank killed by a stop signal from outside: most likely one sent
            # to the whole job, whose other ranks may be saving (whole grace).
            self._stop(failure=failure.during_stop or ended_of(failure) not in STOP_SIGNALS)
        elif not st.stopping and not msg.get("during_stop"):  # may explain a later failure
            st.early_exits.append(RankFailure.from_event(host, msg))

    def _ended(self, index: int, host: str) -> None:
        st = self.state
        if index not in st.open_nodes:
            return  # already given up on (lost)
        st.open_nodes.discard(index)
        for collection in st.collections.values():
            collection.ended([index])
        missing = sorted(st.unreported.get(index, ()))
        if index in st.done and missing and index not in st.agent_failed:
            # ``done`` without the exit of every rank it started: the agent
            # broke off its supervision, never a clean finish.
            self._agent_failed(index, host, (
                f"node agent on {host} ended without reporting the exit of rank(s) "
                f"{','.join(map(str, missing))}"), time.monotonic())
        if index not in st.done:
            if missing:
                st.ended[index] = (tuple(missing), st.stopping)
            channel = self.handle.channels[index]
            code = channel.wait(timeout=1)
            sig = channel.exit_signal()
            st.dropped.append(RankFailure(
                host=host, rank=None, code=code, signal=sig, time=time.time(),
                during_stop=st.stopping, message=self.handle.exit_message(index, code),
                seen=time.monotonic()))
            st.failures.append(st.dropped[-1])
            self._stop(failure=True)

    def _agent_failed(self, index: int, host: str, message: str, seen: float) -> None:
        st = self.state
        st.agent_failed.add(index)
        st.failures.append(RankFailure(host=host, rank=None, code=1, signal=None,
                                       time=time.time(), during_stop=st.stopping,
                                       message=message, seen=seen))
        self._stop(failure=True)

    # -- liveness -------------------------------------------------------------
    def _check_liveness(self, now: float) -> None:
        limit = self.watch.heartbeat_timeout
        if not limit:
            return
        st = self.state
        for index in sorted((st.open_nodes - st.done) & set(self.handle.watched)):
            silent = now - self.handle.last_seen[index]
            if silent <= limit:
                continue
            host = st.hosts[index]
            # the ranks this agent runs: with one agent per rank (mpirun, srun)
            # the host's other agents are not lost
            mine = sorted(st.unreported.get(index, ()))
            shared = sum(h == host for h in st.hosts) > 1
            ranks = f"; rank(s) {','.join(map(str, mine))} ran there, and its agent " \
                f"stops them by itself when it hears nothing from dsrun" if mine else ""
            st.failures.append(RankFailure(
                host=host, rank=None, code=None, signal=None, time=time.time(),
                during_stop=st.stopping, lost=True, seen=self.handle.last_seen[index],
                message=(f"nothing heard from it for {silent:.1f}s (--heartbeat_timeout "
                         f"{limit:g}){ranks}"), agent_ranks=tuple(mine) if shared else ()))
            st.open_nodes.discard(index)
            st.unconfirmed.add(index)
            for collection in st.collections.values():
                collection.ended([index])
            self.handle.drop(index)
            who = f"host {host}" if not shared else f"an agent on host {host}" if not mine \
                else f"the agent of rank {','.join(map(str, mine))} on host {host}"
            self.watch.say(f"{who} lost: nothing heard from it for {silent:.1f}s; stopping "
                           f"the job on every other {'agent' if shared else 'host'}")
            self._stop(failure=True)

    # -- --timeout (its stacks: supervisor_stacks.py) --------------------------
    def _check_timeout(self, now: float) -> None:
        st = self.state
        timeout = self.watch.timeout
        if timeout is None or st.timed_out is not None or st.stopping:
            return
        if now - self.watch.started < timeout:
            return
        st.timed_out = timeout
        st.running_at_timeout = tuple(
            RunningRank(s.host, r, s.pid, now - s.started)
            for r, s in sorted(st.ranks.items()) if s.ended is None)
        running = f"{len(st.running_at_timeout)} rank(s) still running" if st.ranks else \
            "the ranks still starting"
        self.watch.say(f"--timeout {timeout:g}s reached with {running}: collecting their "
                       "stacks, then stopping the job")
        st.timeout_asked = now
        st.timeout_stacks = self._ask_stacks(now + TIMEOUT_STACK_WAIT, lambda line: None)

    def _drop_silent(self, silent: set[int]) -> None:
        """Hosts whose agents sent nothing at all since a --timeout asked for
        stacks (a link down, heartbeats off) would not confirm a stop either:
        they are not waited for. Their agents stop the ranks when the
        connection ends (or when dsrun falls silent, with heartbeats on)."""
        st = self.state
        asked = st.timeout_asked
        # Agents heard from since the request are alive (slow to dump hung ranks).
        silent = {i for i in silent & st.open_nodes if self.handle.last_seen[i] < asked}
        for index in sorted(silent):
            st.no_stacks.add(index)
            st.unconfirmed.add(index)
            st.open_nodes.discard(index)
            self.handle.drop(index)
        if silent:
            hosts = ", ".join(st.hosts[i] for i in sorted(silent))
            self.watch.say(f"no stacks from {hosts} within {TIMEOUT_STACK_WAIT:g}s; "
                           f"not waiting for it to stop")
