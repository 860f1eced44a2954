"""Failures as data, and the one root-cause report the CLI prints.

Every agent reports each rank's exit; the launcher keeps the failures and,
at the end, names the earliest one that was not caused by the teardown
itself (ranks killed because another rank failed are consequences). Which
one that is - the ordering on the launcher's clock, peer losses, early
exits, signals sent to the whole job - is report_causes.py's; its names are
re-exported here. When failures came from more than one host, the report
says which host's clock ordered them.

A rank that ends with status 0 while others still run is the likely cause
of a peer loss or a stop signal that follows it closely
(report_causes.EARLY_EXIT_WINDOW): the report then names that rank, still
shows the failure that followed (its traceback and output), and the job
exits 1, as mpirun does.
"""

from __future__ import annotations

import signal as _signal
import socket
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from dsrun.errors import RANK_LOST
from dsrun.launcher.agent_stop import FAILURE_GRACE
from dsrun.launcher.report_causes import (
    EARLY_EXIT_WINDOW,
    EXITED_PEER,
    JOB_WIDE_WINDOW,
    PEER_WINDOW,
    ended_of,
    exited_peers,
    interruption,
    order,
    root_cause,
    signalled_agent,
)

#: Exit status of a job ended by --timeout (as GNU timeout).
TIMEOUT_EXIT = 124
# report_causes' names, for the launcher and the tests that import them here
__all__ = ["EARLY_EXIT_WINDOW", "EXITED_PEER", "JOB_WIDE_WINDOW", "PEER_WINDOW", "JobResult",
           "RankFailure", "RunningRank", "SigKilled", "Unconfirmed", "ended_of", "exited_peers",
           "interruption", "ranks_on_hosts", "report_lines", "restartable", "root_cause",
           "signal_name", "signalled_agent", "sigkill_lines", "timeout_lines", "unconfirmed_lines"]

#: What the error of a rank that lost a peer says (lower case): gloo's
#: "Connection reset/closed by peer", a write into a closed socket, the c10d
#: store's "Connection was likely closed" (rank 0, its server, died), NCCL's
#: remote error, dsrun's checkpoint exchange (``errors.RANK_LOST``).
PEER_LOSS_MARKS = ("by peer", "broken pipe", "connection was likely closed",
                   "ncclremoteerror", "remote process exit", RANK_LOST.lower())
#: Errors recorded by the runtime that recur on every attempt: a restart
#: cannot clear them (the same script, arguments, config and world size).
NOT_RESTARTABLE = ("DsrunConfigError", "DsrunUsageError")


@dataclass(frozen=True)
class RankFailure:
    host: str
    rank: int | None  # None: the node agent (or its host) failed
    code: int | None
    signal: int | None
    time: float  # wall clock of the failure's host (shown, never compared across hosts)
    during_stop: bool = False
    error: dict[str, Any] | None = None
    tail: tuple[str, ...] = ()
    message: str = ""
    seen: float | None = None  # launcher's monotonic clock: when it happened, as learned
    lost: bool = False  # the host went silent (heartbeat timeout)
    signalled: bool = False  # the node agent itself got a stop signal (``signal``)
    #: A node agent's failure where its host has several (mpirun, srun: one
    #: agent per rank): the ranks that agent ran, which name it.
    agent_ranks: tuple[int, ...] = ()

    @property
    def exit_code(self) -> int:
        if self.signal is not None:
            return 128 + self.signal
        # None or negative (no status known, e.g. a lost connection): 1.
        return self.code if self.code is not None and self.code > 0 else 1

    @property
    def peer_loss(self) -> bool:
        """The rank failed because a peer went away (its own record says so)."""
        message = str((self.error or {}).get("message") or "").lower()
        return any(mark in message for mark in PEER_LOSS_MARKS)

    def summary(self) -> str:
        """One line of what the rank reported: its recorded message (a dsrun
        error, ``sys.exit``) or the last line of its traceback; "" if none."""
        error = self.error or {}
        lines = str(error.get("message") or "").strip().splitlines()
        if error.get("traceback"):
            lines = str(error["traceback"]).strip().splitlines() or lines
            return lines[-1] if lines else ""
        return lines[0] if lines else ""

    @property
    def early_exit(self) -> bool:
        """A rank's exit with status 0 (only an early exit is ever a cause)."""
        return self.rank is not None and self.code == 0 and self.signal is None

    def cause(self) -> str:
        if self.rank is None and self.message:  # the agent's channel said why
            return self.message
        if self.signal is not None:
            return f"killed by signal {signal_name(self.signal)}"
        if self.message:
            return self.message
        if self.early_exit:
            return "exited with status 0 while other ranks were still running"
        return f"exit code {self.code}"

    @classmethod
    def from_event(cls, host: str, msg: dict[str, Any]) -> RankFailure:
        """A rank's ``exit`` event."""
        return cls(host=host, rank=msg.get("rank"), code=msg.get("code"),
                   signal=msg.get("signal"), time=float(msg.get("time", 0.0)),
                   during_stop=bool(msg.get("during_stop")), error=msg.get("error"),
                   tail=tuple(msg.get("tail") or ()), seen=_seen(msg))

    @classmethod
    def from_signal_event(cls, host: str, msg: dict[str, Any]) -> RankFailure:
        """A node agent's ``signal`` event: the agent was signalled, and the
        ranks it then stopped are consequences."""
        sig = int(msg["signal"])
        return cls(host=host, rank=None, code=None, signal=sig,
                   time=float(msg.get("time", 0.0)), during_stop=bool(msg.get("during_stop")),
                   message=f"got {signal_name(sig)} (a signal to the agent, not a rank failure)",
                   seen=_seen(msg), signalled=True)


def _seen(msg: dict[str, Any]) -> float | None:
    """When the event's failure happened on the launcher's monotonic clock."""
    recv = msg.get("_recv")
    return None if recv is None else float(recv) - float(msg.get("age") or 0.0)


@dataclass(frozen=True)
class RunningRank:
    """A rank still running when the job was ended (--timeout)."""

    host: str
    rank: int
    pid: int | None
    seconds: float  # how long it had been running


@dataclass(frozen=True)
class SigKilled:
    """Ranks that one node agent had to SIGKILL while stopping the job."""

    host: str
    ranks: tuple[int, ...]
    after: str  # the stop's first signal: "SIGTERM", or "SIGINT" for a Ctrl-C
    at_once: bool  # hurried (a further signal) before --kill_grace was over
    short: bool = False  # a failure's stop: agent_stop.FAILURE_GRACE, not --kill_grace


@dataclass(frozen=True)
class Unconfirmed:
    """A node agent that never confirmed its ranks' stop (it sent no ``done``)."""

    host: str
    ranks: tuple[int, ...]  # the ranks it started whose exit it had not reported
    #: Its connection ended (the agent was killed, or its link dropped);
    #: False: dsrun gave up on it (lost, or silent past the stop's deadline).
    ended: bool = False
    #: srun got a signal of its own and SIGKILLed every task of its step.
    forced: bool = False


@dataclass(frozen=True)
class JobResult:
    failures: tuple[RankFailure, ...] = ()
    interrupted: int | None = None  # signal that stopped dsrun
    killed: int = 0  # processes that needed SIGKILL during teardown
    timed_out: float | None = None  # --timeout seconds, when it ended the job
    restarts: int = 0  # attempts before this one (--timeout counts them too)
    running: tuple[RunningRank, ...] = ()  # ranks still running at the timeout
    stacks: tuple[str, ...] = ()  # their Python stacks, "[host:rank] line"
    clock: str = ""  # the launcher's host, whose clock ordered the failures
    #: Agents given up on before they said ``done`` (lost, or dropped at the
    #: stop deadline), and those that ended without it while the job was
    #: stopping: their ranks could not be confirmed stopped.
    unconfirmed: tuple[Unconfirmed, ...] = ()
    #: Hosts that sent no stacks when --timeout asked for them.
    no_stacks: tuple[str, ...] = ()
    #: No rank had reported starting (a signal or --timeout during the start).
    starting: bool = False
    #: A signal to dsrun that came while a failure was already ending the
    #: job: the failure stays the cause; no restart after it.
    hurried: int | None = None
    #: Ranks that exited with status 0 before the job was being stopped
    #: (module docstring: they may be why it was).
    early_exits: tuple[RankFailure, ...] = ()
    #: The backend's name (``openmpi``, ...): the report's wording of a stop
    #: signal after an early exit names mpirun only under mpirun.
    launcher: str = ""
    #: Ranks still running when the stop's grace ran out (or was cut short),
    #: killed with SIGKILL: what they did on the stop signal was cut off.
    sigkilled: tuple[SigKilled, ...] = ()
    kill_grace: float | None = None  # --kill_grace seconds

    @property
    def root_cause(self) -> RankFailure | None:
        return root_cause(self.failures, self.early_exits)

    @property
    def trigger(self) -> RankFailure | None:
        """The failure that an early exit (the root cause) explains: the one
        the report shows after it; None when the root cause is no early exit."""
        cause = self.root_cause
        return root_cause(self.failures) if cause is not None and cause.early_exit else None

    @property
    def exit_code(self) -> int:
        if self.interrupted is not None:
            return 128 + self.interrupted
        if self.timed_out is not None:
            return TIMEOUT_EXIT
        cause = self.root_cause
        return 0 if cause is None else cause.exit_code


def signal_name(num: int) -> str:
    try:
        return _signal.Signals(num).name
    except ValueError:
        return f"signal {num}"


def restartable(failure: RankFailure | None) -> bool:
    """False when the failure recurs on every attempt (NOT_RESTARTABLE)."""
    return failure is None or (failure.error or {}).get("exc_type") not in NOT_RESTARTABLE


def report_lines(result: JobResult) -> list[str]:
    """The report, one line per list entry (without trailing newline)."""
    if result.timed_out is not None:
        return timeout_lines(result)
    cause = result.root_cause
    if cause is None:
        return []
    if cause.lost:
        lines = [f"job failed: {_agent_name(cause)} was lost first: {cause.cause()}"]
    elif cause.signalled:
        lines = [f"job failed: node agent on host {cause.host} {cause.cause()}; it stopped "
                 f"its ranks"]
    elif cause.early_exit:
        lines = [f"job failed: {_who(cause)} {cause.cause()} (the likely cause)"]
    else:
        lines = [f"job failed: {_who(cause)} failed first: {cause.cause()}"]
    trigger = result.trigger
    lines.extend(_error_lines(cause))
    if trigger is not None:  # what followed, with its own traceback and output
        lines.extend(_after_early_exit(cause, trigger, result.launcher))
        lines.extend(_error_lines(trigger))
    if cause.peer_loss:
        lines.append("(this rank lost a peer, and no other failure was reported close to it: "
                     "look for a host or process that went away)")
        lines.extend(_earlier_exits(cause, result.early_exits))
    # ranks only: with one agent per rank (mpirun, srun) every signalled agent
    # leaves a record of its own besides its rank's
    others = [f for f in result.failures
              if f is not cause and f is not trigger and f.rank is not None]
    same = [f for f in others if _same_error(f, cause)]
    peers = [f for f in others if f.peer_loss and not _same_error(f, cause)]
    if same:
        lines.append(f"{len(same)} other rank(s) failed with the same error")
    if peers:
        lines.append(f"{len(peers)} other rank(s) failed as a consequence: their connection "
                     f"to a rank that went away was closed")
    if len(others) > len(same) + len(peers):
        lines.append(f"{len(others) - len(same) - len(peers)} other rank(s) stopped as a "
                     f"consequence")
    if len({f.host for f in result.failures}) > 1:
        lines.append(f"(failures ordered on the clock of {result.clock or socket.gethostname()}"
                     f", where dsrun runs: when it learned of each, less the delay each "
                     f"agent measured; host clocks are never compared)")
    lines.extend(sigkill_lines(result))
    lines.extend(unconfirmed_lines(result))
    lines.append(f"exit code {result.exit_code}")
    return lines


def _after_early_exit(cause: RankFailure, trigger: RankFailure, launcher: str) -> list[str]:
    """What followed the early exit that is the root cause: the failure it
    explains (``trigger``: a stop signal to an agent, or a rank's peer loss)."""
    later = ""
    if cause.seen is not None and trigger.seen is not None:
        later = f", {max(trigger.seen - cause.seen, 0.0):.1f}s later"
    if trigger.signalled:
        why = ("mpirun stops the job when one of its ranks ends without calling MPI_Finalize "
               "(an MPI program must call it before any rank exits)") \
            if launcher == "openmpi" else \
            (f"taken as the reaction to that exit, which came at most "
             f"{EARLY_EXIT_WINDOW:g}s before; if the signal was sent for another reason "
             f"(scancel, a preemption, kill), that is the cause")
        return [f"then{later}, the node agent on host {trigger.host} got "
                f"{signal_name(trigger.signal or 0)} and stopped its ranks: {why}"]
    kind = (trigger.error or {}).get("exc_type")
    if cause.rank in exited_peers(trigger):
        return [f"then{later}, {_who(trigger)} failed{f' ({kind})' if kind else ''}: it was "
                f"still waiting for rank {cause.rank} (its error says so)"]
    return [f"then{later}, {_who(trigger)} failed{f' ({kind})' if kind else ''}: it lost its "
            f"connection to a peer (a rank that ends while the others still expect it in a "
            f"collective makes them fail)"]


def _earlier_exits(cause: RankFailure, early_exits: Sequence[RankFailure]) -> list[str]:
    """A note on ranks that had exited with status 0 before the peer loss
    ``cause``, too long before to be blamed (module docstring)."""
    before = [e for e in early_exits if order(e) <= order(cause)]
    if not before:
        return []
    first = min(before, key=order)
    ago = f" {cause.seen - first.seen:.1f}s" if cause.seen is not None \
        and first.seen is not None else ""
    return [f"(note: {_who(first)} had exited with status 0{ago} before; if this rank still "
            f"expected it in a collective, that exit is the cause)"]


def _who(cause: RankFailure) -> str:
    if cause.rank is not None:
        return f"rank {cause.rank} on host {cause.host}"
    return f"the node agent on host {cause.host}"


def _agent_name(failure: RankFailure) -> str:
    """``host vm``, or ``the agent of rank 1 on host vm`` where the host has
    one agent per rank (mpirun, srun): the host itself was not lost."""
    if failure.agent_ranks:
        return f"the agent of rank {_rank_ranges(list(failure.agent_ranks))} on host " \
            f"{failure.host}"
    return f"host {failure.host}"


def _error_lines(cause: RankFailure) -> list[str]:
    lines = []
    error = cause.error or {}
    clock = f" ({cause.host}'s clock)"
    if error.get("traceback"):
        lines.append(f"error in rank {cause.rank} at {error.get('time_str', '?')}{clock}:")
        lines.extend("  " + ln for ln in error["traceback"].rstrip("\n").splitlines())
    elif error.get("message"):
        lines.append(f"  {error['message']}")
        if error.get("where"):
            lines.append(f"  at {error['where']}")
    tail = _tail_before_traceback(cause.tail) if error.get("traceback") else cause.tail
    if tail:
        lines.append(f"last {len(tail)} line(s) of rank {cause.rank}'s output:")
        lines.extend(f"  [{cause.host}:{cause.rank}] {ln}" for ln in tail)
    return lines


def _same_error(failure: RankFailure, cause: RankFailure) -> bool:
    """The rank raised the cause's exception itself: its own error record
    says so (a rank stopped by the teardown leaves none, or another). Ranks
    that fail together are milliseconds apart, so its exit may fall after
    the teardown began, or be the teardown's signal while it was exiting."""
    mine, theirs = failure.error or {}, cause.error or {}
    return bool(mine.get("message")) and \
        (mine.get("exc_type"), mine.get("message")) == (theirs.get("exc_type"),
                                                         theirs.get("message"))


def timeout_lines(result: JobResult) -> list[str]:
    """The report of a job ended by --timeout: who still ran, and where."""
    running = result.running
    counted = f", counted from the first of {result.restarts + 1} attempts" \
        if result.restarts else ""
    still = f"{len(running)} rank(s) still running" if running else \
        "no rank had reported running yet (the attempt was starting)" if result.starting else \
        "no rank still running"
    lines = [f"job timed out after {result.timed_out:g}s (--timeout{counted}): {still}"]
    for r in running:
        pid = f", pid {r.pid}" if r.pid is not None else ""
        lines.append(f"  rank {r.rank} on host {r.host}{pid}, running for {r.seconds:.0f}s")
    if result.stacks:
        lines.append("their Python stacks when the timeout hit:")
        lines.extend(f"  {line}" for line in result.stacks)
    if result.no_stacks:
        lines.append(f"no stacks from {', '.join(result.no_stacks)}: its agent did not "
                     f"answer in time (host down or unreachable?)")
    lines.extend(sigkill_lines(result))
    lines.extend(unconfirmed_lines(result))
    lines.append(f"exit code {result.exit_code}")
    return lines


def sigkill_lines(result: JobResult) -> list[str]:
    """The ranks the teardown had to SIGKILL, so that a save on Ctrl-C or
    a ``finally`` block cut off by it is not taken for one that finished."""
    lines = []
    for at_once in (False, True):
        for after, short in sorted({(k.after, k.short and not at_once)
                                    for k in result.sigkilled if k.at_once == at_once}):
            group = [k for k in result.sigkilled
                     if (k.at_once, k.after, k.short and not at_once) == (at_once, after, short)]
            who, count = ranks_on_hosts((k.host, k.ranks) for k in group)
            they, them = ("it", "it") if count == 1 else ("they", "them")
            what = "a save in except KeyboardInterrupt" if after == "SIGINT" else \
                f"a {after} handler"
            cut = f"anything {they} still did - {what}, finally, atexit - was cut off"
            if at_once:
                lines.append(f"{who} killed with SIGKILL before --kill_grace ran out, after "
                             f"{after} (a further signal hurried the stop): {cut}")
            elif any(k.short for k in group):  # a failure's stop (agent_stop.FAILURE_GRACE)
                lines.append(f"{who} still running {FAILURE_GRACE:g}s after {after}: killed "
                             f"with SIGKILL ({cut}; a failure's stop gives --kill_grace, at "
                             f"most {FAILURE_GRACE:g}s: a rank left blocked in a collective "
                             f"with the one that failed cannot save anything)")
            else:
                grace = f" {result.kill_grace:g}s" if result.kill_grace is not None else ""
                # Still running: saving, or blocked in C code (a CUDA call, an
                # NCCL collective whose peer is gone), where Python never gets to
                # run a handler. More grace helps only the first.
                lines.append(f"{who} still running --kill_grace{grace} after {after}: killed "
                             f"with SIGKILL ({cut}; a longer --kill_grace helps only a rank "
                             f"that was acting on {after}, a save in a handler: one blocked "
                             f"in C code - a CUDA call, an NCCL collective - never sees it)")
    return lines


def ranks_on_hosts(pairs: Iterable[tuple[str, Iterable[int]]],
                   shown: int = 8) -> tuple[str, int]:
    """``rank 0, 1 on host a; rank 4-7 on host b`` for (host, ranks) pairs,
    and how many ranks that is (a host without ranks: ``the ranks on host c``)."""
    by_host: dict[str, set[int]] = {}
    for host, ranks in pairs:
        by_host.setdefault(host, set()).update(ranks)
    parts = [f"rank {_rank_ranges(sorted(ranks))} on host {host}" if ranks else
             f"the ranks on host {host}" for host, ranks in list(by_host.items())[:shown]]
    if len(by_host) > shown:
        parts.append(f"and ranks on {len(by_host) - shown} more host(s)")
    return "; ".join(parts), sum(len(r) for r in by_host.values())


def _rank_ranges(ranks: list[int]) -> str:
    """``0, 1, 4-7``: runs of three or more consecutive ranks as a range."""
    parts: list[str] = []
    start = 0
    for i in range(1, len(ranks) + 1):
        if i == len(ranks) or ranks[i] != ranks[i - 1] + 1:
            run = ranks[start:i]
            parts.append(f"{run[0]}-{run[-1]}" if len(run) > 2 else ", ".join(map(str, run)))
            start = i
    return ", ".join(parts)


def unconfirmed_lines(result: JobResult) -> list[str]:
    """The ranks whose stop no agent confirmed, by why (Unconfirmed)."""
    lines = []
    silent = [(u.host, u.ranks) for u in result.unconfirmed if not u.ended]
    if silent:
        lines.append(f"{ranks_on_hosts(silent)[0]} could not be confirmed stopped (no answer "
                     f"from the agent; it stops them when its connection closes, or when it "
                     f"hears nothing from dsrun for --heartbeat_timeout)")
    forced = [(u.host, u.ranks) for u in result.unconfirmed if u.ended and u.forced]
    if forced:
        lines.append(f"{ranks_on_hosts(forced)[0]} killed with SIGKILL by srun, with every "
                     f"task of its step, before the agent could confirm their stop: what they "
                     f"still did on the signal (a save) was cut off")
    ended = [(u.host, u.ranks) for u in result.unconfirmed if u.ended and not u.forced]
    if ended:
        lines.append(f"{ranks_on_hosts(ended)[0]} could not be confirmed stopped: the agent "
                     f"ended before confirming their stop (it was killed, or its connection "
                     f"dropped, and its ranks die with it): what they still did on the signal "
                     f"(a save) may not have completed")
    return lines


def _tail_before_traceback(tail: Sequence[str]) -> tuple[str, ...]:
    """The output tail without the traceback the report already shows."""
    for i in range(len(tail) - 1, -1, -1):
        if tail[i].startswith("Traceback (most recent call last):"):
            return tuple(tail[:i])
    return tuple(tail)
