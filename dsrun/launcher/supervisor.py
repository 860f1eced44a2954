"""The launcher's event loop over a running job.

It streams rank output to a sink, collects rank exits, and stops every node
when the first failure arrives or when dsrun itself is signalled. It ends
when every agent has said ``done`` (all its processes are gone) or has
disappeared. Agents that ignore a stop are killed after a deadline; their
guard processes then clean up what they left.
"""

from __future__ import annotations

import queue
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from dsrun.launcher.backends.base import JobHandle
from dsrun.launcher.report import JobResult, RankFailure

# (host, rank, fd, line) -> None
OutputSink = Callable[[str, int, int, str], None]

# Extra seconds an agent gets beyond the kill grace to report ``done``.
AGENT_SLACK = 10.0


class Interrupted(Exception):
    """Raised by the launcher's signal handlers (SIGINT, SIGTERM, SIGHUP)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def raise_interrupted(signum: int, frame: object) -> None:
    raise Interrupted(signum)


@dataclass
class _State:
    hosts: list[str]
    open_nodes: set[int]
    done: set[int] = field(default_factory=set)
    failures: list[RankFailure] = field(default_factory=list)
    stopping: bool = False
    deadline: float = 0.0
    interrupted: int | None = None
    killed: int = 0


class Supervisor:
    def __init__(self, handle: JobHandle, hosts: list[str], sink: OutputSink,
                 kill_grace: float, on_start: Callable[[str, int], None] | None = None) -> None:
        self.handle = handle
        self.sink = sink
        self.grace = kill_grace
        self.on_start = on_start
        self.state = _State(hosts=list(hosts), open_nodes=set(range(len(hosts))))

    def run(self) -> JobResult:
        st = self.state
        try:
            while st.open_nodes:
                try:
                    self._step()
                except Interrupted as exc:
                    if st.interrupted is not None:  # second signal: no more patience
                        self.handle.kill()
                    st.interrupted = exc.signum
                    self._stop()
        finally:
            self.handle.close()
        return JobResult(tuple(st.failures), st.interrupted, st.killed)

    def _stop(self) -> None:
        st = self.state
        if not st.stopping:
            st.stopping = True
            st.deadline = time.monotonic() + self.grace + AGENT_SLACK
            self.handle.stop()

    def _step(self) -> None:
        st = self.state
        try:
            index, msg = self.handle.events.get(timeout=0.2)
        except queue.Empty:
            if st.stopping and time.monotonic() > st.deadline:
                self.handle.kill()
                st.deadline = float("inf")
            return
        self._handle(index, msg)

    def _handle(self, index: int, msg: dict[str, Any]) -> None:
        st = self.state
        ev = msg.get("ev")
        host = st.hosts[index]
        if ev == "out":
            self.sink(host, msg["rank"], msg["fd"], msg["line"])
        elif ev == "hello":
            st.hosts[index] = msg.get("host") or host
        elif ev == "started" and self.on_start is not None:
            self.on_start(host, msg["rank"])
        elif ev == "exit":
            if msg.get("code") != 0:
                st.failures.append(RankFailure.from_event(host, msg))
                self._stop()
        elif ev == "done":
            st.done.add(index)
            st.killed += int(msg.get("killed", 0))
        elif ev == "eof":
            st.open_nodes.discard(index)
            if index not in st.done:
                code = self.handle.channels[index].wait(timeout=1)
                st.failures.append(RankFailure(
                    host=host, rank=None, code=code, signal=None, time=time.time(),
                    during_stop=st.stopping, message=self.handle.exit_message(index, code)))
                self._stop()
        elif ev in ("garbage", "agent_err"):
            self.sink(host, -1, 2, msg["line"])
