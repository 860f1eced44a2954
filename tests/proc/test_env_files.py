"""Real processes: env-file values as a rank gets them from its node agent.

One rank, --dist_backend none: the test costs about one interpreter start.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys

import pytest

from tests.conftest import ROOT, dsrun_argv, run_dsrun

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


def test_a_dsrun_inside_a_rank_gets_none_of_the_outer_jobs_settings(tmp_path):
    """A job started from a rank of another (its launcher's environment
    holds the outer rank's DSRUN_CONFIG, DSRUN_CPU_AFFINITY, ...) ran its
    ranks with the outer job's config, CPU binding and backend."""
    script = tmp_path / "show.py"
    out = tmp_path / "env.json"
    script.write_text(f"#!{sys.executable}\nimport json, os\n"
                      f"open({str(out)!r}, 'w').write(json.dumps(sorted(\n"
                      f"    k for k in os.environ if k.startswith('DSRUN_'))))\n")
    script.chmod(0o755)
    outer = {"DSRUN_CONFIG": str(tmp_path / "parent.json"), "DSRUN_CPU_AFFINITY": "0",
             "DSRUN_DIST_BACKEND": "none", "DSRUN_ACCELERATOR": "cpu",
             "DSRUN_LOCAL_RANK_FILL": "0", "DSRUN_JOB_ID": "outer", "DSRUN_AGENT_PID": "1",
             "DSRUN_STACK_FILE": "/nonexistent/stack", "DSRUN_TEST_OWN": "kept"}
    res = run_dsrun("--num_gpus", "1", "--no_python", str(script), env=outer, timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]
    got = json.loads(out.read_text())
    assert "DSRUN_TEST_OWN" in got  # the user's own DSRUN_ variables still pass
    for key in ("DSRUN_CONFIG", "DSRUN_CPU_AFFINITY", "DSRUN_DIST_BACKEND",
                "DSRUN_ACCELERATOR", "DSRUN_LOCAL_RANK_FILL"):
        assert key not in got, got


@pytest.mark.parametrize("command", [(), ("doctor",)])
def test_a_deleted_working_directory_is_one_line(tmp_path, command):
    gone = tmp_path / "gone"
    gone.mkdir()
    script = tmp_path / "s.py"
    script.write_text("print('ran')\n")
    argv = " ".join(shlex.quote(a) for a in dsrun_argv(*command, *ONE, str(script)))
    res = subprocess.run(["sh", "-c", f"cd {shlex.quote(str(gone))} && rmdir "
                          f"{shlex.quote(str(gone))} && exec {argv}"],
                         capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PWD": str(gone), "PYTHONPATH": str(ROOT)})
    assert res.returncode == 2, res.stderr
    assert res.stderr.strip() == (f"dsrun: error: the working directory {gone} no longer "
                                  f"exists (deleted after the shell entered it): cd to an "
                                  f"existing directory"), res.stderr
    assert "ran" not in res.stdout
