"""Multi-host jobs over SSH on the simulated cluster: results, failures, signals.

Every test is also checked by the bench's autouse fixture: nothing of the
job may be left on any host afterwards. Workers run with --dist_backend
none (no torch) except the all_reduce test.
"""

from __future__ import annotations

import signal
import time
from pathlib import Path

import psutil
import pytest
from simhosts import SimCluster
from sshjobs import BEHAVE, WORKERS, run, ssh_flags, start, wait_files, write_hostfile

from tests.conftest import wait_gone

pytestmark = pytest.mark.cluster


def _behave(cluster: SimCluster, hostfile: str, *extra: str, grace: float = 1.0) -> list[str]:
    return ["-H", hostfile, *ssh_flags(cluster), "--dist_backend", "none",
            "--kill_grace", str(grace), BEHAVE, *extra]


def test_allreduce_over_two_hosts_from_node1(sim_cluster: SimCluster, tmp_path: Path) -> None:
    hostfile = write_hostfile(sim_cluster, tmp_path / "hostfile", ["node1", "node2"], slots=2)
    res = run(sim_cluster, "-H", hostfile, *ssh_flags(sim_cluster),
              str(WORKERS / "allreduce.py"), on="node1", timeout=120)
    assert res.returncode == 0, res.stderr
    for rank, host in [(0, "node1"), (1, "node1"), (2, "node2"), (3, "node2")]:
        assert f"[{host}:{rank}] rank {rank}/4 backend gloo sum 10" in res.stdout, res.stdout
    assert "node1: ranks [0,1]  local ranks [0,1]  devices [cpu]" in res.stderr
    assert "node2: ranks [2,3]  local ranks [0,1]  devices [cpu]" in res.stderr
    master = sim_cluster.host("node1").address
    assert f"master {master}:" in res.stderr  # node1's bridge address, not loopback


def test_cores_bound_per_rank_on_every_host(sim_cluster: SimCluster, tmp_path: Path) -> None:
    """--bind_cores_to_rank over SSH: the CPUs each host may use come from
    its probe, and every rank binds itself to its share."""
    script = tmp_path / "where.py"
    script.write_text("import os\nprint('cpus', sorted(os.sched_getaffinity(0)), "
                      "os.environ['OMP_NUM_THREADS'], flush=True)\n")
    hostfile = write_hostfile(sim_cluster, tmp_path / "hostfile", ["node1", "node2"], slots=2)
    res = run(sim_cluster, "-H", hostfile, *ssh_flags(sim_cluster), "--dist_backend", "none",
              "--bind_core_list", "0-1", str(script), on="node1", timeout=120)
    assert res.returncode == 0, res.stderr
    for rank, host, cpu in [(0, "node1", 0), (1, "node1", 1), (2, "node2", 0),
                            (3, "node2", 1)]:
        assert f"[{host}:{rank}] cpus [{cpu}] 1" in res.stdout, res.stdout
    assert res.stderr.count("CPUs per rank: [0]  [1]") == 2, res.stderr


def test_rank_failure_on_host2_stops_host1_fast(sim_cluster: SimCluster, tmp_path: Path) -> None:
    hostfile = write_hostfile(sim_cluster, tmp_path / "hostfile", ["node1", "node2"], slots=2)
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()
    proc = start(sim_cluster, *_behave(sim_cluster, hostfile, "--pid_dir", str(pid_dir),
                                       "--fail_rank", "2", "--code", "7", "--delay", "1"),
                 on="node1")
    try:
        pids = wait_files(pid_dir, 4)
        up = time.monotonic()
        node1 = [pids["rank_0.pid"], pids["rank_1.pid"]]
        # rank 2 fails about 1 s after it wrote its pid file
        assert wait_gone(node1, 1 + 5) == [], "ranks on node1 outlived the failure by > 5 s"
        gone_after = time.monotonic() - up
        out, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 7, err
    assert "job failed: rank 2 on host node2 failed first: exit code 7" in err
    assert "[node2:2] rank 2 exiting with 7" in err  # output tail in the report
    assert gone_after < 6, gone_after


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGKILL])
def test_signal_to_dsrun_leaves_nothing_on_any_host(sim_cluster: SimCluster, tmp_path: Path,
                                                    sig: signal.Signals) -> None:
    hostfile = write_hostfile(sim_cluster, tmp_path / "hostfile", ["node1", "node2"], slots=2)
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()
    proc = start(sim_cluster, *_behave(sim_cluster, hostfile, "--pid_dir", str(pid_dir),
                                       "--grandchild", "setsid"), on="node1")
    try:
        pids = wait_files(pid_dir, 8)  # 4 ranks, 4 grandchildren that left their group
        proc.send_signal(sig)
        start_stop = time.monotonic()
        proc.wait(timeout=20)
        assert wait_gone(list(pids.values()), 5) == []
        stopped_in = time.monotonic() - start_stop
        err = proc.stderr.read() if proc.stderr else ""
    finally:
        proc.kill()
        proc.communicate()
    sim_cluster.wait_clean(15)  # agents, guards and sshd sessions' children too
    assert stopped_in < 6, stopped_in
    if sig == signal.SIGINT:
        assert proc.returncode == 130, err
        assert "stopped by SIGINT; every rank was stopped" in err
        assert "job failed" not in err  # ranks killed by the stop are no failure
    else:
        assert proc.returncode == -signal.SIGKILL


def _sshd_sessions(cluster: SimCluster, host: str) -> list[psutil.Process]:
    """The per-connection sshd processes on host (not its listener)."""
    found = []
    for pid in cluster.pids_in(host):  # the listener is not listed
        try:
            proc = psutil.Process(pid)
            if proc.name().startswith("sshd"):
                found.append(proc)
        except psutil.NoSuchProcess:
            continue
    return found


def test_lost_ssh_connection_stops_the_job(sim_cluster: SimCluster, tmp_path: Path) -> None:
    hostfile = write_hostfile(sim_cluster, tmp_path / "hostfile", ["node1", "node2"], slots=1)
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()
    proc = start(sim_cluster, *_behave(sim_cluster, hostfile, "--pid_dir", str(pid_dir)),
                 on="node1")
    try:
        pids = wait_files(pid_dir, 2)
        sessions = _sshd_sessions(sim_cluster, "node2")
        assert sessions
        for session in sessions:  # the connection dies as if the network dropped it
            session.kill()
        out, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert wait_gone(list(pids.values()), 5) == []
    assert proc.returncode != 0
    assert "the node agent on host node2 failed first: lost the SSH connection to node2" \
        in err, err


def test_a_second_sigint_kills_remote_ranks_that_ignore_sigterm(sim_cluster: SimCluster,
                                                                tmp_path: Path) -> None:
    """The second Ctrl-C used to close the SSH connections, which node2's
    agent took as one more stop: its rank ran on until the 30 s grace ended,
    while dsrun had already said every rank was stopped."""
    hostfile = write_hostfile(sim_cluster, tmp_path / "hostfile", ["node1", "node2"], slots=1)
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()
    proc = start(sim_cluster, *_behave(sim_cluster, hostfile, "--pid_dir", str(pid_dir),
                                       "--ignore_term_rank", "1", grace=30), on="node1")
    try:
        pids = wait_files(pid_dir, 2)
        proc.send_signal(signal.SIGINT)
        time.sleep(1)
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=20)
        left = wait_gone(list(pids.values()), 1)
        err = proc.stderr.read() if proc.stderr else ""
    finally:
        proc.kill()
        proc.communicate()
    assert proc.returncode == 130, err
    assert left == [], "node2's rank outlived dsrun's 'every rank was stopped'"
    assert "stopped by SIGINT; every rank was stopped" in err
    sim_cluster.wait_clean(15)  # at once when clean; ranks sleep 60 s if leaked
