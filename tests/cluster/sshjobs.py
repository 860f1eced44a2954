"""Helpers for the SSH launcher tests: run dsrun on or against simulated hosts.

dsrun is pointed at the bench's ssh_config (which names its key and
known_hosts) with ``--ssh_config``; nothing here relies on ~/.ssh. ``on=``
runs the launcher inside a host's namespaces (its hostname, its network),
as a user logged into that node would; without it the launcher runs in the
root namespace, which is not one of the hosts.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from simhosts import SimCluster

ROOT = Path(__file__).resolve().parents[2]
WORKERS = ROOT / "tests" / "proc" / "workers"
CLUSTER_WORKERS = ROOT / "tests" / "cluster" / "workers"
BEHAVE = str(WORKERS / "behave.py")


def write_hostfile(cluster: SimCluster, path: Path, hosts: Sequence[str], slots: int) -> str:
    path.write_text(cluster.hostfile_text(slots=slots, hosts=hosts))
    return str(path)


def dsrun_argv(cluster: SimCluster, *args: str, on: str | None = None,
               cwd: Path = ROOT) -> list[str]:
    argv = [sys.executable, "-m", "dsrun.launcher.cli", *args]
    if on is None:
        return argv
    return cluster.nsenter_argv(on, ["env", "-C", str(cwd), *argv])


def ssh_flags(cluster: SimCluster) -> list[str]:
    return ["--ssh_config", cluster.ssh_config_path]


def run(cluster: SimCluster, *args: str, on: str | None = None, cwd: Path = ROOT,
        timeout: float = 60, env: dict[str, str] | None = None
        ) -> subprocess.CompletedProcess[str]:
    # With on=, `env -C` enters cwd inside the host, where it may be all that exists.
    return subprocess.run(dsrun_argv(cluster, *args, on=on, cwd=cwd), capture_output=True,
                          text=True, timeout=timeout, cwd=str(ROOT if on else cwd),
                          env={**os.environ, **(env or {})})


def start(cluster: SimCluster, *args: str, on: str | None = None, cwd: Path = ROOT,
          env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    return subprocess.Popen(dsrun_argv(cluster, *args, on=on, cwd=cwd), text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            cwd=str(ROOT if on else cwd),
                            env={**os.environ, **(env or {})})


def wait_files(directory: Path, count: int, timeout: float = 30) -> dict[str, int]:
    """Wait for ``count`` pid files in ``directory``; name -> pid."""
    end = time.monotonic() + timeout
    found: dict[str, int] = {}
    while time.monotonic() < end:
        found = {}
        for f in directory.iterdir():
            text = f.read_text().strip()
            if text:
                found[f.name] = int(text)
        if len(found) >= count:
            return found
        time.sleep(0.05)
    raise AssertionError(f"only {sorted(found)} appeared in {directory} within {timeout}s")
