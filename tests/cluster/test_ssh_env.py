"""Environment propagation to remote ranks: values arrive, yet never show.

The launcher runs in the root namespace (not one of the hosts), so every
agent is remote and starts in its SSH login environment.
"""

from __future__ import annotations

import hashlib
import os
import sys
import uuid
from pathlib import Path

import pytest
from simhosts import SimCluster
from sshjobs import CLUSTER_WORKERS, run, ssh_flags, start, wait_files, write_hostfile

pytestmark = pytest.mark.cluster
SHOW_ENV = str(CLUSTER_WORKERS / "show_env.py")


def _sha(value: str) -> str:
    return hashlib.sha256(value.encode()).hexdigest()


def _cmdlines_containing(needle: bytes, launcher: int) -> list[str]:
    """Command lines holding needle, of every process on the machine (the
    hosts share its PID namespace) but the launcher, where the user typed it."""
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or int(pid) == launcher:
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read()
        except OSError:
            continue
        if needle in cmdline:
            words = cmdline.replace(b"\0", b" ").decode(errors="replace")
            found.append(f"{pid}: {words}")
    return found


def test_env_reaches_remote_ranks_but_no_command_line_or_log(sim_cluster: SimCluster,
                                                             tmp_path: Path) -> None:
    secret = f"s3cr3t-{uuid.uuid4().hex}"
    file_secret = f"f1le-{uuid.uuid4().hex}"
    work = tmp_path / "work"  # the job's working directory, with an env file
    work.mkdir()
    (work / ".dsrun_env").write_text(f"# comment\nexport FILE_SECRET='{file_secret}'\n\n"
                                     "FROM_FILE=plain\n")
    ready = tmp_path / "ready"
    ready.mkdir()
    hostfile = write_hostfile(sim_cluster, tmp_path / "hostfile", ["node2", "node3"], slots=1)
    args = ["-H", hostfile, *ssh_flags(sim_cluster), "--dist_backend", "none",
            "--env", f"SECRET={secret}", "--env_prefix", "MYAPP_", SHOW_ENV,
            "--hash", "SECRET", "FILE_SECRET",
            "--show", "FROM_FILE", "DSRUN_FWD", "MYAPP_X", "OTHER_X", "GLOO_SOCKET_IFNAME",
            "NCCL_SOCKET_IFNAME", "MASTER_ADDR", "PATH",
            "--ready_dir", str(ready), "--sleep", "3"]
    launcher_env = {"DSRUN_FWD": "fwd", "MYAPP_X": "app", "OTHER_X": "other"}

    dry = run(sim_cluster, "--dry-run", *args, cwd=work, env=launcher_env)
    assert dry.returncode == 0, dry.stderr
    assert "SECRET=<value not shown> (--env)" in dry.stdout
    assert f"FILE_SECRET=<value not shown> ({work}/.dsrun_env:2)" in dry.stdout
    assert "node node2: ssh root@" in dry.stdout and "<chosen at launch>" in dry.stdout
    assert secret not in dry.stdout + dry.stderr and file_secret not in dry.stdout

    proc = start(sim_cluster, *args, cwd=work, env=launcher_env)
    try:
        wait_files(ready, 2)
        leaks = _cmdlines_containing(secret.encode(), proc.pid) + _cmdlines_containing(
            file_secret.encode(), proc.pid)
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 0, err
    assert leaks == []
    assert secret not in out + err and file_secret not in out + err
    master = sim_cluster.host("node2").address
    for rank, host in ((0, "node2"), (1, "node3")):
        seen = [ln.split("] ", 1)[1] for ln in out.splitlines()
                if ln.startswith(f"[{host}:{rank}] ")]
        assert f"SECRET sha256 {_sha(secret)}" in seen
        assert f"FILE_SECRET sha256 {_sha(file_secret)}" in seen
        assert "FROM_FILE=plain" in seen and "DSRUN_FWD=fwd" in seen and "MYAPP_X=app" in seen
        assert "OTHER_X=<unset>" in seen  # not forwarded: no default prefix matches
        assert "GLOO_SOCKET_IFNAME=eth0" in seen and "NCCL_SOCKET_IFNAME=eth0" in seen
        assert f"MASTER_ADDR={master}" in seen
        path = next(ln for ln in seen if ln.startswith("PATH="))
        assert path.startswith(f"PATH={Path(sys.executable).parent}:")
