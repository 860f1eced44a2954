"""Real processes: a node agent SIGKILLed together with its guard (srun
killing its step) leaves its temporary directory; the restarted attempt's
agent removes it (explore22-nodeckpt finding 6: it stayed in /tmp)."""

from __future__ import annotations

import os

import pytest

from tests.conftest import WORKERS, run_dsrun

pytestmark = pytest.mark.proc


def test_the_restarted_agent_removes_the_directory_its_killed_predecessor_left(tmp_path):
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    res = run_dsrun("--cpu", "--num_gpus", "2", "--dist_backend", "none", "--kill_grace", "1",
                    "--max_restarts", "1", str(WORKERS / "kill_agent.py"),
                    env={**os.environ, "TMPDIR": str(tmp)})
    assert res.returncode == 0, res.stderr
    assert "restarting (1/1)" in res.stderr, res.stderr
    assert "tmpdir " + str(tmp) in res.stdout, res.stdout  # the attempt used TMPDIR
    assert sorted(os.listdir(tmp)) == [], res.stderr
