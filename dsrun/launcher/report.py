"""Failures as data, and the one root-cause report the CLI prints.

Every agent reports each rank's exit; the launcher keeps the failures and,
at the end, names the earliest one that was not caused by the teardown
itself (ranks killed because another rank failed are consequences).
"""

from __future__ import annotations

import signal as _signal
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class RankFailure:
    host: str
    rank: int | None  # None: the node agent itself failed
    code: int | None
    signal: int | None
    time: float
    during_stop: bool = False
    error: dict[str, Any] | None = None
    tail: tuple[str, ...] = ()
    message: str = ""

    @property
    def exit_code(self) -> int:
        if self.signal is not None:
            return 128 + self.signal
        return self.code if self.code else 1

    def cause(self) -> str:
        if self.signal is not None:
            return f"killed by signal {signal_name(self.signal)}"
        if self.message:
            return self.message
        return f"exit code {self.code}"

    @classmethod
    def from_event(cls, host: str, msg: dict[str, Any]) -> RankFailure:
        return cls(host=host, rank=msg.get("rank"), code=msg.get("code"),
                   signal=msg.get("signal"), time=float(msg.get("time", 0.0)),
                   during_stop=bool(msg.get("during_stop")), error=msg.get("error"),
                   tail=tuple(msg.get("tail") or ()))


@dataclass(frozen=True)
class JobResult:
    failures: tuple[RankFailure, ...] = ()
    interrupted: int | None = None  # signal that stopped dsrun
    killed: int = 0  # processes that needed SIGKILL during teardown
    stopped_ranks: int = field(default=0)

    @property
    def root_cause(self) -> RankFailure | None:
        return root_cause(self.failures)

    @property
    def exit_code(self) -> int:
        if self.interrupted is not None:
            return 128 + self.interrupted
        cause = self.root_cause
        return 0 if cause is None else cause.exit_code


def signal_name(num: int) -> str:
    try:
        return _signal.Signals(num).name
    except ValueError:
        return f"signal {num}"


def root_cause(failures: Sequence[RankFailure]) -> RankFailure | None:
    """The earliest failure that was not a consequence of stopping the job."""
    if not failures:
        return None
    genuine = [f for f in failures if not f.during_stop]
    return min(genuine or failures, key=lambda f: f.time)


def report_lines(result: JobResult) -> list[str]:
    """The root-cause report, one line per list entry (without trailing newline)."""
    cause = result.root_cause
    if cause is None:
        return []
    who = f"rank {cause.rank} on host {cause.host}" if cause.rank is not None \
        else f"the node agent on host {cause.host}"
    lines = [f"job failed: {who} failed first: {cause.cause()}"]
    error = cause.error or {}
    if error.get("traceback"):
        lines.append(f"error in rank {cause.rank} at {error.get('time_str', '?')}:")
        lines.extend("  " + ln for ln in error["traceback"].rstrip("\n").splitlines())
    elif error.get("message"):
        lines.append(f"  {error['message']}")
    tail = _tail_before_traceback(cause.tail) if error.get("traceback") else cause.tail
    if tail:
        lines.append(f"last {len(tail)} line(s) of rank {cause.rank}'s output:")
        lines.extend(f"  [{cause.host}:{cause.rank}] {ln}" for ln in tail)
    others = [f for f in result.failures if f is not cause]
    if others:
        lines.append(f"{len(others)} other rank(s) stopped as a consequence")
    lines.append(f"exit code {result.exit_code}")
    return lines


def _tail_before_traceback(tail: Sequence[str]) -> tuple[str, ...]:
    """The output tail without the traceback the report already shows."""
    for i in range(len(tail) - 1, -1, -1):
        if tail[i].startswith("Traceback (most recent call last):"):
            return tuple(tail[:i])
    return tuple(tail)
