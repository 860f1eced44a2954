"""A 32-host job on 32 simulated hosts: every rank runs, fail-fast and Ctrl-C
leave nothing behind on any host. (How long it takes against one host is
measured by bench/fanout.py, not here: timing on a shared machine is no
test.)"""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from simhosts import SimCluster, preflight
from sshjobs import WORKERS, run, ssh_flags, start, wait_files

pytestmark = pytest.mark.cluster

HOSTS = 32
HANG = str(WORKERS / "hang.py")


@pytest.fixture(scope="module")
def big_cluster() -> Iterator[SimCluster]:
    reason = preflight()
    if reason is not None:
        pytest.skip(reason)
    cluster = SimCluster(HOSTS, startup_timeout=30.0).start()  # 32 sshd under load
    try:
        yield cluster
    finally:
        cluster.teardown()


@pytest.fixture
def clean32(big_cluster: SimCluster) -> Iterator[SimCluster]:
    yield big_cluster
    try:
        big_cluster.wait_clean(10)
    except AssertionError:
        big_cluster.kill_strays()
        raise


def _hostfile(cluster: SimCluster, tmp_path: Path) -> str:
    path = tmp_path / "hostfile"
    path.write_text(cluster.hostfile_text(slots=1))
    return str(path)


def _args(cluster: SimCluster, tmp_path: Path, *extra: str) -> list[str]:
    return ["-H", _hostfile(cluster, tmp_path), *ssh_flags(cluster), "--dist_backend", "none",
            "--kill_grace", "1", HANG, *extra]


def test_32_hosts_every_rank_runs(clean32: SimCluster, tmp_path: Path) -> None:
    res = run(clean32, *_args(clean32, tmp_path, "--finish", ",".join(map(str, range(HOSTS)))),
              timeout=180)
    assert res.returncode == 0, res.stderr
    for rank in range(HOSTS):
        assert f"[node{rank + 1}:{rank}] rank {rank} done" in res.stdout
    assert f"dsrun: connected {HOSTS}/{HOSTS} hosts, {HOSTS}/{HOSTS} ranks started in " \
        in res.stderr


def test_32_hosts_fail_fast_leaves_nothing(clean32: SimCluster, tmp_path: Path) -> None:
    script = tmp_path / "fail.py"
    script.write_text("import os, sys, time\n"
                      "if os.environ['RANK'] == '17':\n    time.sleep(1); sys.exit(9)\n"
                      "time.sleep(120)\n")
    proc = start(clean32, "-H", _hostfile(clean32, tmp_path), *ssh_flags(clean32),
                 "--dist_backend", "none", "--kill_grace", "1", str(script))
    try:
        out, err = proc.communicate(timeout=180)
    finally:
        proc.kill()
    assert proc.returncode == 9, err
    assert "job failed: rank 17 on host node18 failed first: exit code 9" in err
    clean32.wait_clean(10)


def test_32_hosts_ctrl_c_leaves_nothing(clean32: SimCluster, tmp_path: Path) -> None:
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()
    proc = start(clean32, *_args(clean32, tmp_path, "--pid_dir", str(pid_dir), "--finish",
                                 "none"))
    try:
        wait_files(pid_dir, HOSTS, timeout=120)
        proc.send_signal(signal.SIGINT)
        began = time.monotonic()
        out, err = proc.communicate(timeout=60)
        stopped_in = time.monotonic() - began
    finally:
        proc.kill()
    assert proc.returncode == 130, err
    assert "stopped by SIGINT; every rank was stopped" in err
    clean32.wait_clean(10)
    assert stopped_in < 30, stopped_in
