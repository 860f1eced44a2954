"""Two jobs given the same --master_port at once never form one group.

The launcher's hold on the port ends when the ranks start; rank 0 binds the
store only once torch is imported. Here rank 0 of job A sleeps in between
(a ``sitecustomize`` on the ranks' PYTHONPATH), and job B starts in that
window: its launcher check passes, and one job's rank 1 meets the other
job's store. That job must fail with one error naming the port and the
other job; the other job must run normally.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import time

import pytest

from dsrun.launcher.netinfo import bind_below_ephemeral
from tests.conftest import dsrun_argv

pytestmark = pytest.mark.proc

SITE = '''
import os, time
if os.environ.get("DSRUN_AGENT_PID") and os.environ.get("RANK") == "0":
    delay = float(os.environ.get("RACE_RANK0_DELAY", "0"))
    if delay:
        open(os.environ["RACE_MARK"], "w").close()  # the agent has let the port go
        time.sleep(delay)
'''

SCRIPT = '''
import os, time, torch.distributed as dist
me = os.environ["DSRUN_JOB_ID"]
ids = [None] * dist.get_world_size()
dist.all_gather_object(ids, me)
print(f"job {me} rank {dist.get_rank()} group {' '.join(ids)}", flush=True)
time.sleep(3)  # the port stays this job's while the other one starts
dist.barrier()
'''


def _free_port() -> int:
    """A free port below the ephemeral range, as dsrun picks them (no other
    program's outgoing connection takes it meanwhile)."""
    with socket.socket() as s:
        bind_below_ephemeral(s)
        return int(s.getsockname()[1])


def _start(tmp_path, port: int, delay: float) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "RACE_RANK0_DELAY": str(delay), "RACE_MARK": str(tmp_path / "mark")}
    return subprocess.Popen(dsrun_argv("--cpu", "--num_gpus", "2", "--master_port", str(port),
                                       str(tmp_path / "job.py")),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            cwd=str(tmp_path))


def test_same_master_port_at_once_never_mixes_jobs(tmp_path):
    (tmp_path / "sitecustomize.py").write_text(SITE)
    (tmp_path / "job.py").write_text(SCRIPT)
    port = _free_port()
    first = _start(tmp_path, port, delay=6.0)
    deadline = time.monotonic() + 30
    while not (tmp_path / "mark").exists():  # A's ranks started: its hold on the port is gone
        assert first.poll() is None and time.monotonic() < deadline, first.communicate()[0]
        time.sleep(0.05)
    second = _start(tmp_path, port, delay=0.0)
    outs = [p.communicate(timeout=60)[0] for p in (first, second)]
    codes = [first.returncode, second.returncode]
    groups = [re.findall(r"job (\S+) rank (\d) group (\S+) (\S+)", out) for out in outs]
    for job_groups in groups:
        for me, _rank, *members in job_groups:
            assert members == [me, me], groups  # never another job's rank
    assert sorted(c == 0 for c in codes) == [False, True], (codes, outs)
    win, lose = (0, 1) if codes[0] == 0 else (1, 0)
    assert len(groups[win]) == 2, outs[win]
    winner = groups[win][0][0]
    assert groups[lose] == [], outs[lose]
    assert f"{port}" in outs[lose] and f"dsrun job {winner}" in outs[lose], outs[lose]
    assert "--master_port" in outs[lose] and "Traceback" not in outs[lose], outs[lose]
