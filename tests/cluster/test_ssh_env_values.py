"""What remote ranks get from the launcher, end to end over SSH (every host
remote: the launcher runs in the root namespace). The unit tests show each
piece; only real hosts show that they add up on the remote side: the agent
enters a working directory whose name is not UTF-8, its ranks import the
project's packages from it, expand an env file against the forwarded
values, and get none of a parent job's settings; ``dsrun doctor`` checks
the hosts from that directory.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from simhosts import SimCluster
from sshjobs import dsrun_argv, run, ssh_flags, write_hostfile

pytestmark = pytest.mark.cluster

SHOW = """\
import json, os, sys
try:
    import mypkg
    imported = "ok"
except ImportError as exc:
    imported = repr(exc)
keys = ("XLIB", "NCCL_LIB", "DSRUN_CONFIG", "DSRUN_CPU_AFFINITY", "DSRUN_DIST_BACKEND")
env = {k: os.environ.get(k) for k in keys}
env["import"] = imported
env["cwd"] = os.fsencode(os.getcwd()).hex()
env["path0"] = os.fsencode(os.environ["PYTHONPATH"].split(":")[0]).hex()
open(os.path.join(sys.argv[1], os.environ["RANK"] + ".json"), "w").write(json.dumps(env))
"""


def test_remote_ranks_get_the_launchers_directory_and_forwarded_values(
        sim_cluster: SimCluster, tmp_path: Path) -> None:
    work = Path(os.fsdecode(os.fsencode(str(tmp_path)) + b"/work\xff"))
    (work / "mypkg").mkdir(parents=True)
    (work / "mypkg" / "__init__.py").write_text("")
    (work / "sub").mkdir()
    (work / "sub" / "show.py").write_text(SHOW)
    (work / ".deepspeed_env").write_text("XLIB=$PYTHONXHOME/lib\nNCCL_LIB=${NCCL_HOME}/lib\n")
    out = tmp_path / "out"
    out.mkdir()
    hostfile = write_hostfile(sim_cluster, tmp_path / "hostfile", ["node2", "node3"], slots=1)
    parent = {"DSRUN_CONFIG": str(tmp_path / "parent.json"), "DSRUN_CPU_AFFINITY": "0",
              "DSRUN_DIST_BACKEND": "gloo"}  # as in a rank of another dsrun job
    res = run(sim_cluster, "-H", hostfile, *ssh_flags(sim_cluster), "--dist_backend", "none",
              "sub/show.py", str(out), cwd=work, timeout=120,
              env={"PYTHONXHOME": "/opt/x", "NCCL_HOME": "/opt/nccl", **parent})
    assert res.returncode == 0, res.stderr[-3000:]
    assert "Traceback" not in res.stderr
    doctor = subprocess.run(dsrun_argv(sim_cluster, "doctor", "-H", hostfile,
                                       *ssh_flags(sim_cluster)),
                            capture_output=True, cwd=work, timeout=120)
    said = (doctor.stdout + doctor.stderr).decode(errors="replace")
    assert doctor.returncode == 0 and "Traceback" not in said, said[-3000:]
    assert "all 2 host(s) ok" in said
    for rank in (0, 1):
        got = json.loads((out / f"{rank}.json").read_text())
        assert got["import"] == "ok"
        assert bytes.fromhex(got["cwd"]) == bytes.fromhex(got["path0"]) == os.fsencode(work)
        assert (got["XLIB"], got["NCCL_LIB"]) == ("/opt/x/lib", "/opt/nccl/lib")
        assert got["DSRUN_DIST_BACKEND"] == "none"
        assert got["DSRUN_CONFIG"] is None and got["DSRUN_CPU_AFFINITY"] is None
