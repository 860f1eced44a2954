"""The node agent's orphan reaper (procs.reap_adopted, the agent being a
child subreaper) takes the status of adopted orphans only: never that of a
child it keeps (a rank, whose exit status is the job's; a Popen child,
whose status subprocess owns), even once that child is a zombie.

Run in a process of its own: a subreaper stays one for its whole life."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="PR_SET_CHILD_SUBREAPER is Linux's")

CHECK = """\
import os, subprocess, sys, time
from dsrun.launcher import procs

assert procs.become_subreaper()
kept = subprocess.Popen([sys.executable, "-c", "raise SystemExit(7)"])
rank = subprocess.Popen([sys.executable, "-c", "raise SystemExit(5)"])
# an orphan: its parent exits at once, so it is reparented to this process
out = subprocess.run(["sh", "-c", "sleep 0.3 & echo $!"], capture_output=True, text=True)
orphan = int(out.stdout)
time.sleep(1.0)  # every child has exited: all three are zombies of ours
keep = {kept.pid, rank.pid}
reaped = 0
end = time.monotonic() + 5
while time.monotonic() < end:
    reaped += procs.reap_adopted(keep)
    if not os.path.exists(f"/proc/{orphan}"):
        break
    time.sleep(0.05)
assert reaped == 1, reaped
assert not os.path.exists(f"/proc/{orphan}"), "the orphan was not reaped"
info = os.waitid(os.P_PID, rank.pid, os.WEXITED | os.WNOWAIT)  # as the agent waits
assert info.si_status == 5, info
assert rank.wait() == 5 and kept.wait() == 7
print("ok")
"""


def test_reaping_orphans_never_takes_a_kept_childs_status():
    res = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True,
                         timeout=30, cwd=str(ROOT))
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stderr
