"""The remote node agent imports dsrun with the ranks' PYTHONPATH (the
launcher's, forwarded), as DeepSpeed's pdsh runner exports it for its
per-node launcher, and the preflight tells another copy of the same
version from the launcher's by its sources.

The launcher runs with ``python -I`` (its PYTHONPATH ignored: it imports
the installed dsrun) while PYTHONPATH names a changed copy of the package:
a remote agent that gets the PYTHONPATH imports that copy, which the
preflight must name as another copy than the launcher's. The job runs in
a directory of its own: ``python -m`` puts the working directory first,
and in the repository that would be the installed dsrun again.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from simhosts import SimCluster
from sshjobs import BEHAVE, ssh_flags, write_hostfile

pytestmark = pytest.mark.cluster


def _installed() -> Path:
    """The dsrun that ``python -I`` imports, as the launcher below does (not
    necessarily the one this test imports: the suite may run from a checkout
    on PYTHONPATH)."""
    out = subprocess.run([sys.executable, "-I", "-c", "import dsrun; print(dsrun.__file__)"],
                         capture_output=True, text=True, check=True, cwd="/")
    return Path(out.stdout.strip()).parent


def _changed_copy(tmp_path: Path) -> Path:
    checkout = tmp_path / "checkout"
    shutil.copytree(_installed(), checkout / "dsrun",
                    ignore=shutil.ignore_patterns("__pycache__"))
    with open(checkout / "dsrun" / "launcher" / "agent.py", "a") as f:
        f.write("# a changed copy\n")
    return checkout


def _dsrun(sim_cluster: SimCluster, tmp_path: Path, checkout: Path,
           *args: str) -> subprocess.CompletedProcess:
    hostfile = write_hostfile(sim_cluster, tmp_path / "hostfile", ["node2", "node3"], slots=1)
    command, rest = (list(args[:1]), args[1:]) if args[:1] == ("doctor",) else ([], args)
    return subprocess.run(
        [sys.executable, "-I", "-m", "dsrun.launcher.cli", *command, "-H", hostfile,
         *ssh_flags(sim_cluster), *rest],
        capture_output=True, text=True, timeout=60, cwd=str(tmp_path),
        env={**os.environ, "PYTHONPATH": str(checkout)})


def test_remote_agents_import_dsrun_from_the_launchers_pythonpath(sim_cluster: SimCluster,
                                                                   tmp_path: Path) -> None:
    checkout = _changed_copy(tmp_path)
    res = _dsrun(sim_cluster, tmp_path, checkout, "--dist_backend", "none", BEHAVE,
                 "--pid_dir", str(tmp_path))
    assert res.returncode == 1, res.stderr
    for host in ("node2", "node3"):
        line = next(ln for ln in res.stderr.splitlines() if f" {host} " in ln and "FAIL" in ln)
        assert f"at {checkout / 'dsrun'} is another copy than the launcher's " \
            f"({_installed()})" in line, res.stderr
    assert not list(tmp_path.glob("*.pid")), "a rank started"


def test_doctors_remote_agents_get_the_pythonpath_a_launchs_get(sim_cluster: SimCluster,
                                                                tmp_path: Path) -> None:
    checkout = _changed_copy(tmp_path)
    res = _dsrun(sim_cluster, tmp_path, checkout, "doctor")
    assert res.returncode == 1, res.stdout + res.stderr
    for host in ("node2", "node3"):
        line = next(ln for ln in res.stdout.splitlines() if f" {host} " in ln and "FAIL" in ln)
        assert f"at {checkout / 'dsrun'} is another copy than the launcher's" in line
