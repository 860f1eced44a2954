"""Two jobs given the same --master_port at once never form one group.

The launcher's hold on the port ends when the ranks start; rank 0 binds the
store only once torch is imported. Here rank 0 of job A sleeps in between
(a ``sitecustomize`` on the ranks' PYTHONPATH) until job B, started in
that window, has formed its group on the port: B's launcher check passed,
and A's rank 1 met B's store. That job must fail with one error naming the port and the
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
    if os.environ.get("RACE_HOLD") == "1":
        open(os.environ["RACE_MARK"], "w").close()  # the agent has let the port go
        deadline = time.monotonic() + 120
        while not os.path.exists(os.environ["RACE_RELEASE"]) and time.monotonic() < deadline:
            time.sleep(0.05)  # until the other job's group has formed on the port
'''

SCRIPT = '''
import os, time, torch.distributed as dist
me = os.environ["DSRUN_JOB_ID"]
ids = [None] * dist.get_world_size()
dist.all_gather_object(ids, me)
print(f"job {me} rank {dist.get_rank()} group {' '.join(ids)}", flush=True)
open(os.environ["RACE_RELEASE"], "w").close()  # (only the job holding the port gets here)
deadline = time.monotonic() + 120
while not os.path.exists(os.environ["RACE_DONE"]) and time.monotonic() < deadline:
    time.sleep(0.05)  # the port stays this job's until the other job has ended
dist.barrier()
'''


def _free_port() -> int:
    """A free port below the ephemeral range, as dsrun picks them (no other
    program's outgoing connection takes it meanwhile)."""
    with socket.socket() as s:
        bind_below_ephemeral(s)
        return int(s.getsockname()[1])


def _start(tmp_path, port: int, hold: bool) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "RACE_HOLD": "1" if hold else "0", "RACE_MARK": str(tmp_path / "mark"),
           "RACE_RELEASE": str(tmp_path / "release"), "RACE_DONE": str(tmp_path / "done")}
    return subprocess.Popen(dsrun_argv("--cpu", "--num_gpus", "2", "--master_port", str(port),
                                       str(tmp_path / "job.py")),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            cwd=str(tmp_path))


def test_same_master_port_at_once_never_mixes_jobs(tmp_path):
    (tmp_path / "sitecustomize.py").write_text(SITE)
    (tmp_path / "job.py").write_text(SCRIPT)
    port = _free_port()
    first = _start(tmp_path, port, hold=True)
    deadline = time.monotonic() + 30
    while not (tmp_path / "mark").exists():  # A's ranks started: its hold on the port is gone
        assert first.poll() is None and time.monotonic() < deadline, first.communicate()[0]
        time.sleep(0.05)
    second = _start(tmp_path, port, hold=False)
    try:
        outs = [first.communicate(timeout=180)[0]]
        (tmp_path / "done").touch()
        outs.append(second.communicate(timeout=180)[0])
    finally:
        (tmp_path / "done").touch()
        (tmp_path / "release").touch()
        for job in (first, second):
            if job.poll() is None:
                job.kill()
                job.wait()
    codes = [first.returncode, second.returncode]
    groups = [re.findall(r"job (\S+) rank (\d) group (\S+) (\S+)", out) for out in outs]
    for job_groups in groups:
        for me, _rank, *members in job_groups:
            assert members == [me, me], groups  # never another job's rank
    # A's rank 0 waits until B's group formed on the port: B wins, always
    assert codes[1] == 0 and codes[0] != 0, (codes, outs)
    win, lose = 1, 0
    assert len(groups[win]) == 2, outs[win]
    winner = groups[win][0][0]
    assert groups[lose] == [], outs[lose]
    assert f"{port}" in outs[lose] and f"dsrun job {winner[:12]}" in outs[lose], outs[lose]
    assert "--master_port" in outs[lose] and "Traceback" not in outs[lose], outs[lose]
