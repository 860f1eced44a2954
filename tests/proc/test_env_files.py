"""Real processes: env-file values as a rank gets them from its node agent.

One rank, --dist_backend none: the test costs about one interpreter start.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest

from tests.conftest import run_dsrun

pytestmark = pytest.mark.proc
ONE = ["--cpu", "--num_gpus", "1", "--dist_backend", "none"]


@pytest.mark.parametrize("launcher", [
    "local",
    pytest.param("openmpi", marks=pytest.mark.skipif(shutil.which("mpirun") is None,
                                                     reason="mpirun not installed")),
])
def test_env_file_references_are_expanded_by_the_agent(tmp_path, launcher):
    """`PATH=/opt/bin:$PATH` gave the rank a literal `$PATH` (no `ls` found
    any more; under mpirun, mpirun itself got it too); and a local job took
    ~/.deepspeed_env, which DeepSpeed reads only for jobs on several hosts."""
    home, work = tmp_path / "home", tmp_path / "work"
    home.mkdir()
    work.mkdir()
    (home / ".deepspeed_env").write_text("GLOO_SOCKET_IFNAME=ib0\n")
    (work / ".dsrun_env").write_text(
        "PATH=/opt/nothing/bin:$PATH\n"
        "LIT='${HOME}'\n"
        "BRACED=${HOME}/x:$DSRUN_TEST_UNSET_VAR\n")
    (work / "show.py").write_text(
        "import json, os, shutil, sys\n"
        "keys = ('PATH', 'LIT', 'BRACED', 'GLOO_SOCKET_IFNAME')\n"
        "env = {k: os.environ.get(k) for k in keys}\n"
        "env['ls'] = shutil.which('ls')\n"
        "open(sys.argv[1], 'w').write(json.dumps(env))\n")
    out = tmp_path / "env.json"
    environ = {"HOME": str(home), "PATH": os.environ["PATH"]}
    res = run_dsrun("--launcher", launcher, *ONE, "show.py", str(out), cwd=str(work),
                    env=environ, timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]
    got = json.loads(out.read_text())
    # the PATH the agent started with: dsrun's own (mpirun puts its bin in front)
    assert got["PATH"].startswith("/opt/nothing/bin:") and "$" not in got["PATH"]
    assert got["PATH"].endswith(f":{os.environ['PATH']}")
    if launcher == "local":
        assert got["PATH"] == f"/opt/nothing/bin:{os.environ['PATH']}"
    assert got["ls"] is not None
    assert got["LIT"] == "${HOME}"
    assert got["BRACED"] == f"{home}/x:"
    assert got["GLOO_SOCKET_IFNAME"] is None
    assert (f"dsrun: env file {home}/.deepspeed_env not applied: DeepSpeed's env files apply "
            f"only to jobs on several hosts") in res.stderr
