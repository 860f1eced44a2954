"""Real processes: a stop signal that reaches the node agent in the middle
of handling a failure never loses the failure (agent_hold.held_signals).

A thread's failure reaches the main loop as a queued ``("fail", message)``;
a SIGTERM right after the loop dequeued it (its handler raises Stop in the
main thread) used to drop it, and one between ``_fail`` flagging the
failure sent and sending it dropped it for good (later failures skip the
send): the launcher then saw only the signal, not the host's root cause.
The tests force each interleaving: the agent runs with a hook that
signals the agent itself at exactly that point.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.proc

# The agent's main(), with its event queue holding a thread's failure from
# the start, and signalling the agent as the main loop dequeues it.
AT_DEQUEUE = """
import os, queue, signal, sys
from dsrun.launcher import agent
class Hooked(queue.Queue):
    def __init__(self):
        super().__init__()
        self.put(("fail", "a log file of this host cannot be written (test)"))
    def get(self, *args, **kwargs):
        event = super().get(*args, **kwargs)
        if isinstance(event, tuple):
            os.kill(os.getpid(), signal.SIGTERM)  # its handler runs at the next bytecode
        return event
real_init = agent.Agent.__init__
def init(self, *args, **kwargs):
    real_init(self, *args, **kwargs)
    self.events = Hooked()
agent.Agent.__init__ = init
sys.exit(agent.main())
"""

# The same failure, and the agent signalled as _fail is about to send it.
AT_SEND = """
import os, queue, signal, sys
from dsrun.launcher import agent
class Failing(queue.Queue):
    def __init__(self):
        super().__init__()
        self.put(("fail", "a log file of this host cannot be written (test)"))
real_init = agent.Agent.__init__
def init(self, *args, **kwargs):
    real_init(self, *args, **kwargs)
    self.events = Failing()
agent.Agent.__init__ = init
real = agent.Agent.emit
def emit(self, obj, control=True):
    if obj.get("ev") == "fail":
        os.kill(os.getpid(), signal.SIGTERM)  # its handler runs at the next bytecode
    return real(self, obj, control)
agent.Agent.emit = emit
sys.exit(agent.main())
"""


def _events(tmp_path, hooked: str, ranks: list[list[str]] | None = None,
            kill_grace: float = 2) -> list[dict]:
    """The events of an agent run as ``hooked`` says, its ranks' argvs ``ranks``."""
    argvs = ranks or [[sys.executable, "-c", "import time; time.sleep(30)"]]
    payload = {"job_id": "f" * 32, "kill_grace": kill_grace, "cwd": str(tmp_path), "env": {},
               "ranks": [{"rank": r, "local_rank": r, "runtime": True, "argv": argv,
                          "env": {"dsrun": {"RANK": str(r)}, "defaults": {},
                                  "path_prepend": []}} for r, argv in enumerate(argvs)]}
    proc = subprocess.Popen([sys.executable, "-c", hooked], cwd=str(ROOT),
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL)
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write((json.dumps(payload) + "\n").encode())
    proc.stdin.flush()
    events: list[dict] = []
    end = time.monotonic() + 60
    try:
        for line in proc.stdout:
            events.append(json.loads(line))
            if events[-1].get("ev") == "done" or time.monotonic() > end:
                break
    finally:
        proc.stdin.close()
        proc.wait(timeout=20)
    return events


@pytest.mark.parametrize("hook", [AT_DEQUEUE, AT_SEND], ids=["dequeued", "being-sent"])
def test_a_sigterm_while_a_failure_is_handled_does_not_lose_it(tmp_path, hook):
    events = _events(tmp_path, hook)
    kinds = [e["ev"] for e in events]
    assert "done" in kinds, events
    fails = [e["message"] for e in events if e["ev"] == "fail"]
    assert fails == ["a log file of this host cannot be written (test)"], events
    # the signal came after the failure: the launcher counts it too
    assert any(e["ev"] == "signal" and e["signal"] == 15 for e in events), events


# SIGTERM then SIGINT while a rank's exit is reported (agent.exit_event):
# the first stops the job, the second - held behind it - hurries the stop.
TWO_SIGNALS = """
import os, signal, sys
from dsrun.launcher import agent
real = agent.exit_event
calls = []
def hooked(*args, **kwargs):
    if not calls:
        calls.append(1)
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGINT)
    return real(*args, **kwargs)
agent.exit_event = hooked
sys.exit(agent.main())
"""

STUBBORN = """
import os, signal, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
signal.signal(signal.SIGINT, signal.SIG_IGN)
open(sys.argv[1], "w").close()
time.sleep(60)
"""


def test_a_second_signal_held_behind_the_first_hurries_the_stop(tmp_path):
    flag = tmp_path / "ready"
    ranks = [[sys.executable, "-c", "import os, time\nwhile not os.path.exists("
              f"{str(flag)!r}): time.sleep(0.02)"],
             [sys.executable, "-c", STUBBORN, str(flag)]]
    start = time.monotonic()
    events = _events(tmp_path, TWO_SIGNALS, ranks, kill_grace=20)
    assert events[-1]["ev"] == "done", events
    # the ranks' grace (20 s) was cut short: SIGKILL at once
    assert time.monotonic() - start < 10, events
    assert [e["signal"] for e in events if e["ev"] == "signal"][:1] == [15], events
