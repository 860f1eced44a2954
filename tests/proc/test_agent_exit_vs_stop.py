"""Real processes: a stop signal that reaches the node agent while it is
reporting a rank's exit never loses that exit.

The agent marks a rank reported and then sends its ``exit`` event; a
SIGTERM between the two (its handler raises Stop in the main thread) used
to leave the rank marked but never told: the launcher got ``done``
without the rank's exit ("ended without reporting the exit of rank(s)").
The test forces that interleaving: the agent runs with its exit-event
builder wrapped so that it signals the agent itself, at exactly that point.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.proc

# The agent's main(), with agent.exit_event signalling the agent the first
# time it runs (between "reported" and the ``exit`` event).
HOOKED = """
import os, signal, sys
from dsrun.launcher import agent
real = agent.exit_event
calls = []
def hooked(*args, **kwargs):
    if not calls:
        calls.append(1)
        os.kill(os.getpid(), signal.SIGTERM)  # its handler runs at the next bytecode
    return real(*args, **kwargs)
agent.exit_event = hooked
sys.exit(agent.main())
"""


def test_a_sigterm_while_an_exit_is_reported_does_not_lose_the_exit(tmp_path):
    payload = {"job_id": "f" * 32, "kill_grace": 2, "cwd": str(tmp_path), "env": {},
               "ranks": [{"rank": 0, "local_rank": 0, "runtime": True,
                          "argv": [sys.executable, "-c", "raise SystemExit(0)"],
                          "env": {"dsrun": {"RANK": "0"}, "defaults": {},
                                  "path_prepend": []}}]}
    proc = subprocess.Popen([sys.executable, "-c", HOOKED], cwd=str(ROOT),
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL)
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write((json.dumps(payload) + "\n").encode())
    proc.stdin.flush()
    events: list[dict] = []
    end = time.monotonic() + 30
    try:
        for line in proc.stdout:
            events.append(json.loads(line))
            if events[-1].get("ev") == "done" or time.monotonic() > end:
                break
    finally:
        proc.stdin.close()
        proc.wait(timeout=10)
    kinds = [e["ev"] for e in events]
    assert "done" in kinds, events
    exits = [e for e in events if e["ev"] == "exit"]
    assert [(e["rank"], e["code"]) for e in exits] == [(0, 0)], events
    # the signal was the agent's, and it said so (the launcher counts it)
    assert any(e["ev"] == "signal" and e["signal"] == 15 for e in events), events
