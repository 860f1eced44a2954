"""Real processes (gloo ranks): a rank that leaves through ``os._exit``
posts no exit mark of its own (runtime/exitmark.py), so its node agent
posts it (launcher/agent_marks.py) and the peer's checkpoint agreement
names it within a second or two. The old code left the peer waiting the
whole ``checkpoint.timeout`` (60 s here).

And the agent posts only into its own job's store: ranks that met
another job's store on their --master_port (two jobs given one port at
once: runtime/rendezvous.py) exit without a mark, and their agent must
not post ``rank N exited`` into the other job's store, whose rank N is
alive (its checkpoint calls would fail on it).
"""

from __future__ import annotations

import datetime
import json
import os
import socket
import subprocess
import time

import pytest
import torch.distributed as dist

from dsrun.launcher.netinfo import bind_below_ephemeral
from dsrun.runtime.exitmark import COUNT_KEY
from dsrun.runtime.rendezvous import JOB_KEY
from tests.conftest import ROOT, dsrun_argv, run_dsrun
from tests.proc.test_checkpoint_crash import clean_env

pytestmark = pytest.mark.proc

WORKER = ROOT / "tests" / "proc" / "workers" / "os_exit_job.py"

# In the ranks (not the agent): wait, before torch is imported, until the
# test holds the port with another job's store.
SITE = '''
import os, time
if os.environ.get("DSRUN_AGENT_PID"):
    open(os.environ["RACE_MARK"] + os.environ["RANK"], "w").close()
    deadline = time.monotonic() + 60
    while not os.path.exists(os.environ["RACE_RELEASE"]) and time.monotonic() < deadline:
        time.sleep(0.05)
'''

SCRIPT = '''
import torch.distributed as dist
import dsrun
dsrun.init_distributed()
dist.barrier()
'''


def test_a_rank_gone_through_os_exit_before_the_save_is_named_at_once(tmp_path):
    res = run_dsrun("--cpu", "--num_gpus", "2", str(WORKER), "--exiter", "1",
                    "--timeout", "60", "--out", str(tmp_path), timeout=120, env=clean_env())
    assert res.returncode == 1, res.stderr[-3000:]
    saver = json.loads((tmp_path / "saver.json").read_text())
    assert saver["rank"] == 0 and saver["seconds"] < 5, saver  # about 1.5 s here
    assert ("engine.save_checkpoint() failed on rank 0: rank 1 exited (status 0) before "
            "calling engine.save_checkpoint()" in saver["error"]), saver
    ckpt = tmp_path / "ckpt"
    assert (ckpt / "latest").read_text().strip() == "t1"
    assert not [p.name for p in ckpt.iterdir() if p.name.startswith("t2")]


def test_ranks_that_met_another_job_s_store_get_no_mark_posted_there(tmp_path):
    (tmp_path / "sitecustomize.py").write_text(SITE)
    (tmp_path / "job.py").write_text(SCRIPT)
    with socket.socket() as s:
        bind_below_ephemeral(s)
        port = int(s.getsockname()[1])
    env = clean_env(PYTHONPATH=f"{tmp_path}{os.pathsep}{ROOT}",
                    RACE_MARK=str(tmp_path / "mark"), RACE_RELEASE=str(tmp_path / "release"))
    job = subprocess.Popen(dsrun_argv("--cpu", "--num_gpus", "2", "--master_port", str(port),
                                      str(tmp_path / "job.py")),
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           env=env, cwd=str(tmp_path))
    try:
        deadline = time.monotonic() + 60
        while not all((tmp_path / f"mark{r}").exists() for r in (0, 1)):
            assert job.poll() is None and time.monotonic() < deadline, job.communicate()[0]
            time.sleep(0.05)
        # the launcher's hold on the port is gone: "the other job" takes it
        other = dist.TCPStore("127.0.0.1", port, 2, True, wait_for_workers=False,
                              timeout=datetime.timedelta(seconds=10))
        other.set(JOB_KEY, "f00dfeedf00dfeedf00dfeed")
        (tmp_path / "release").touch()
        out = job.communicate(timeout=120)[0]
    finally:
        (tmp_path / "release").touch()
        if job.poll() is None:
            job.kill()
            job.wait()
    assert job.returncode != 0 and "dsrun job f00dfeedf00d" in out, out[-3000:]
    time.sleep(0.5)  # (an agent's posting thread would be done long before this)
    leaked = [k for k in ("dsrun/exited/0", "dsrun/exited/1", COUNT_KEY) if other.check([k])]
    assert leaked == [], out[-3000:]
