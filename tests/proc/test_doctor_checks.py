"""``dsrun doctor`` checks what a launch's preflight checks, with the agents
started as a launch starts them: the job's ``--log_dir`` files (leaving
nothing behind), and the dsrun copy the agent imports with the ranks'
PYTHONPATH (here from ``--env``, which reaches the local agent too)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from tests.conftest import WORKERS, run_dsrun


def test_doctor_checks_the_log_files_and_leaves_none(tmp_path):
    logs = tmp_path / "logs"
    (logs / "rank_1.log").mkdir(parents=True)
    res = run_dsrun("doctor", "--cpu", "--num_gpus", "2", "--log_dir", str(logs),
                    str(WORKERS / "hang.py"), timeout=60)
    assert res.returncode == 1, res.stdout + res.stderr
    assert f"cannot open the --log_dir file {logs / 'rank_1.log'}: [Errno 21] Is a " \
        "directory" in res.stdout, res.stdout
    assert sorted(p.name for p in logs.iterdir()) == ["rank_1.log"], "the check left files"


def test_a_launch_that_fails_its_preflight_leaves_no_log_files(tmp_path):
    logs = tmp_path / "logs"
    (logs / "rank_1.log").mkdir(parents=True)
    res = run_dsrun("--cpu", "--num_gpus", "2", "--log_dir", str(logs), "--dist_backend",
                    "none", str(WORKERS / "hang.py"), "--pid_dir", str(tmp_path), timeout=60)
    assert res.returncode == 1, res.stderr
    assert sorted(p.name for p in logs.iterdir()) == ["rank_1.log"], "empty rank logs left"
    assert "--no_preflight" not in res.stderr, "it does not skip this check"


def _installed() -> Path:
    """The dsrun that ``python -I`` imports (not necessarily this test's)."""
    out = subprocess.run([sys.executable, "-I", "-c", "import dsrun; print(dsrun.__file__)"],
                         capture_output=True, text=True, check=True, cwd="/")
    return Path(out.stdout.strip()).parent


def test_doctors_local_agent_gets_the_ranks_pythonpath_from_env(tmp_path):
    checkout = tmp_path / "checkout"
    shutil.copytree(_installed(), checkout / "dsrun", ignore=shutil.ignore_patterns("__pycache__"))
    with open(checkout / "dsrun" / "launcher" / "agent.py", "a") as f:
        f.write("# a changed copy\n")
    script = tmp_path / "job.py"
    script.write_text("pass\n")
    res = subprocess.run(
        [sys.executable, "-I", "-m", "dsrun.launcher.cli", "doctor", "--cpu", "--num_gpus",
         "1", "--env", f"PYTHONPATH={checkout}", str(script)],
        capture_output=True, text=True, timeout=60, cwd=str(tmp_path))
    assert res.returncode == 1, res.stdout + res.stderr
    assert f"at {checkout / 'dsrun'} is another copy than the launcher's" in res.stdout, \
        res.stdout
