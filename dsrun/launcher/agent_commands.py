"""The node agent's handling of the launcher's commands (protocol.COMMANDS)
and of the SIGUSR1/SIGUSR2 it passes on to its ranks (agent_forward.py).

Commands are read on a thread of their own: what they ask of the ranks
(stop, kill) goes to the agent's main loop through its event queue, since
only the main thread stops ranks; ``stack`` answers on a thread of its
own; ``pause``/``resume`` only set the link's output flag. End of the
launcher's input is the ``eof`` event. Kept to the standard library: every
agent imports it.
"""

from __future__ import annotations

import queue
import signal
import threading
from typing import Any

from dsrun import stackdump
from dsrun.launcher import agent_forward, procs
from dsrun.launcher.agent_output import Rank, guarded
from dsrun.launcher.agent_stop import JobProcesses, leaders
from dsrun.launcher.link import END, Link


class Commands:
    """The Agent's command handling (a mixin: the state is the Agent's)."""

    link: Link
    events: queue.Queue[Any]
    ranks: list[Rank]
    job: JobProcesses
    forwarder: agent_forward.Forwarder
    stack_lock: threading.Lock
    stop_signal: signal.Signals
    stop_failure: bool

    def emit(self, obj: dict[str, Any], control: bool = True) -> None:
        raise NotImplementedError  # the Agent's

    def _thread_failed(self, exc: BaseException) -> None:
        raise NotImplementedError  # the Agent's

    def _read_commands(self) -> None:
        try:
            while True:
                msg = self.link.get(None)
                if msg is END:
                    break
                handler = self.commands.get(str(msg.get("cmd")))
                if handler is not None:  # unknown commands: from a newer launcher
                    handler(msg)
        finally:  # an error here is a crash (guarded), and no command comes any more
            self.events.put("eof")

    @property
    def commands(self) -> dict[str, Any]:
        """Launcher commands (protocol.COMMANDS) -> what the agent does."""
        return {"stop": self._stop_command,
                "kill": lambda msg: self.events.put("kill"),
                "signal": lambda msg: agent_forward.from_launcher(msg.get("signal")),
                "pause": lambda msg: self.link.pause_output(True),
                "resume": lambda msg: self.link.pause_output(False),
                "stack": lambda msg: guarded(self._stacks, self._thread_failed,
                                             msg.get("req"))}

    def _stop_command(self, msg: dict[str, Any]) -> None:
        if msg.get("signal") == "SIGINT":
            self.stop_signal = signal.SIGINT  # the job was Ctrl-C'd: the ranks are too
        self.stop_failure = bool(msg.get("failure"))  # a failure elsewhere: a short grace
        self.events.put("stop")

    def _stacks(self, req: Any) -> None:
        """Each running rank's Python stacks (stackdump.answers), then ``stack_end``."""
        with self.stack_lock:
            for answer in stackdump.answers([r for r in self.ranks if r.status is None]):
                self.emit({"ev": "stack", "req": req, **answer})
            self.emit({"ev": "stack_end", "req": req})

    def _forward_pending(self) -> None:
        """SIGUSR1/SIGUSR2 to the agent or from the launcher (agent_forward.py)."""
        for signum, launcher in agent_forward.take():
            if not self.job.stopping:
                self.forwarder.note(signum, launcher)
        if self.job.stopping:
            self.forwarder.drop()
        else:
            self.forwarder.settle()

    def _forward(self, signum: int) -> None:
        procs.signal_groups(leaders([r for r in self.ranks if r.status is None]), signum)
