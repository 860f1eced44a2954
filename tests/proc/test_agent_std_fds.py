"""A node agent started with stdin, stdout or stderr closed (``dsrun ...
2>&-`` runs the local agent so) puts /dev/null on them before it makes any
pipe: its guard puts /dev/null over fds 0-2, and a pipe of the agent's
there would be cut - the guard then exited at once and the job failed
with "its guard process ... exited"."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.conftest import ROOT

PROBE = """
import os, sys
from dsrun.launcher.agent import _open_std_fds
_open_std_fds()
read, write = os.pipe()
sys.stderr.write("stderr works\\n")
print(read > 2 and write > 2, os.path.realpath(f"/proc/self/fd/{FD}"))
"""


@pytest.mark.parametrize("fd", [0, 2])
def test_closed_std_fds_get_dev_null_before_any_pipe(fd: int) -> None:
    res = subprocess.run(["sh", "-c", f'exec "$@" {fd}<&-', "sh", sys.executable, "-c",
                          PROBE.replace("FD", str(fd))],
                         capture_output=True, text=True, timeout=60, cwd=str(ROOT))
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == ["True", "/dev/null"], res.stdout
