"""Hosts that go silent, and hung ranks, on the simulated cluster.

- A host whose network link goes down mid-job (its TCP connections stall,
  they do not close) is declared lost after --heartbeat_timeout: the job
  stops on the other hosts, the report names the lost host, and the lost
  host's agent - hearing nothing from the launcher - stops its ranks by
  itself, while the link is still down.
- ``dsrun stack`` prints the Python stack of every rank on every host.
- A multi-host start shows its progress as plain lines in a log.
"""

from __future__ import annotations

import time
from pathlib import Path

import psutil
import pytest
from simhosts import SSHD_NAMES, SimCluster
from sshjobs import WORKERS, run, ssh_flags, start, wait_files, write_hostfile

from tests.conftest import wait_gone

pytestmark = pytest.mark.cluster

HANG = str(WORKERS / "hang.py")


def _job_procs(cluster: SimCluster, host: str) -> list[int]:
    """Processes of the job on ``host``: everything there but sshd."""
    found = []
    for pid in cluster.pids_in(host):
        try:
            proc = psutil.Process(pid)
            if proc.name() not in SSHD_NAMES and proc.status() != psutil.STATUS_ZOMBIE:
                found.append(pid)
        except psutil.NoSuchProcess:
            continue
    return found


def test_host_lost_mid_job_is_named_and_its_agent_stops_its_ranks(sim_cluster: SimCluster,
                                                                  tmp_path: Path) -> None:
    hostfile = write_hostfile(sim_cluster, tmp_path / "hostfile", ["node1", "node2"], slots=2)
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()
    proc = start(sim_cluster, "-H", hostfile, *ssh_flags(sim_cluster), "--dist_backend",
                 "none", "--kill_grace", "1", "--heartbeat_timeout", "3", HANG,
                 "--pid_dir", str(pid_dir), "--finish", "none", on="node1")
    try:
        pids = wait_files(pid_dir, 4)
        assert _job_procs(sim_cluster, "node2")
        sim_cluster.link_down("node2")
        cut = time.monotonic()
        try:
            out, err = proc.communicate(timeout=30)
            stopped_in = time.monotonic() - cut
            # node2 on its own: its agent stops its ranks without any word from
            # the launcher, whose connection is stalled, not closed
            deadline = time.monotonic() + 3 + 1 + 10
            while _job_procs(sim_cluster, "node2") and time.monotonic() < deadline:
                time.sleep(0.2)
            left_on_node2 = _job_procs(sim_cluster, "node2")
        finally:
            sim_cluster.link_up("node2")
    finally:
        proc.kill()
    assert proc.returncode == 1, err
    assert "job failed: host node2 was lost first: nothing heard from it for " in err
    assert "rank(s) 2,3 ran there" in err
    assert stopped_in < 3 + 10, stopped_in
    assert wait_gone([pids["rank_0.pid"], pids["rank_1.pid"]], 5) == []  # node1's ranks
    assert left_on_node2 == [], "the lost host's agent left the job running there"


def test_dsrun_stack_shows_every_rank_on_every_host(sim_cluster: SimCluster,
                                                    tmp_path: Path) -> None:
    hostfile = write_hostfile(sim_cluster, tmp_path / "hostfile", ["node1", "node2"], slots=1)
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()
    runtime = tmp_path / "run"
    runtime.mkdir(mode=0o700)
    env = {"XDG_RUNTIME_DIR": str(runtime)}
    proc = start(sim_cluster, "-H", hostfile, *ssh_flags(sim_cluster), "--dist_backend",
                 "none", "--kill_grace", "1", HANG, "--pid_dir", str(pid_dir), "--finish",
                 "none", on="node1", env=env)
    try:
        wait_files(pid_dir, 2)
        time.sleep(0.5)
        res = run(sim_cluster, "stack", on="node1", env=env)
        assert res.returncode == 0, res.stderr
        for host, rank in (("node1", 0), ("node2", 1)):
            frames = [ln for ln in res.stdout.splitlines()
                      if ln.startswith(f"[{host}:{rank}] ")]
            assert any("in wait_forever" in ln for ln in frames), res.stdout
        proc.terminate()
        out, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    # the start in a log: plain progress lines, ending with the time it took
    progress = [ln for ln in err.splitlines() if "ranks started" in ln]
    assert progress[0] == "dsrun: connected 0/2 hosts, 0/2 ranks started"
    assert progress[-1].startswith("dsrun: connected 2/2 hosts, 2/2 ranks started in ")
    assert "\r" not in err


def test_a_suspended_launcher_is_not_taken_for_a_lost_one(sim_cluster: SimCluster,
                                                          tmp_path: Path) -> None:
    """Ctrl-Z for longer than the heartbeat timeout, then fg: the job goes on."""
    import signal

    hostfile = write_hostfile(sim_cluster, tmp_path / "hostfile", ["node1", "node2"], slots=1)
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()
    proc = start(sim_cluster, "-H", hostfile, *ssh_flags(sim_cluster), "--dist_backend",
                 "none", "--heartbeat_timeout", "2", HANG, "--pid_dir", str(pid_dir),
                 "--finish", "none", "--sleep", "15", on="node1")
    try:
        pids = wait_files(pid_dir, 2)
        top = psutil.Process(proc.pid)  # nsenter and env exec into the launcher
        launcher = next(p for p in [top, *top.children(recursive=True)]
                        if "dsrun.launcher.cli" in " ".join(p.cmdline()))
        launcher.send_signal(signal.SIGTSTP)
        time.sleep(5)  # > 2 s of silence
        assert all(psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in pids.values())
        launcher.send_signal(signal.SIGCONT)
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 0, err
    assert "[node2:1] rank 1 done" in out and "lost" not in err


def test_timeout_with_a_host_that_cannot_answer(sim_cluster: SimCluster,
                                                tmp_path: Path) -> None:
    """--timeout while node2's link is down and heartbeats are off: dsrun
    does not wait out the kill grace and the agent slack for node2 (exit 124
    came ~20 s after the cut), and the report says node2 sent no stacks."""
    hostfile = write_hostfile(sim_cluster, tmp_path / "hostfile", ["node1", "node2"], slots=1)
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()
    proc = start(sim_cluster, "-H", hostfile, *ssh_flags(sim_cluster), "--dist_backend",
                 "none", "--kill_grace", "1", "--heartbeat_timeout", "0", "--timeout", "8",
                 HANG, "--pid_dir", str(pid_dir), "--finish", "none", on="node1")
    try:
        wait_files(pid_dir, 2)
        sim_cluster.link_down("node2")
        cut = time.monotonic()
        try:
            out, err = proc.communicate(timeout=40)
            ended_in = time.monotonic() - cut
        finally:
            sim_cluster.link_up("node2")
    finally:
        proc.kill()
        # node2's agent never heard the end (heartbeats off, link was down)
        sim_cluster.kill_strays()
    assert proc.returncode == 124, err
    # --timeout (counted from the start, before the cut), the 5 s stack wait,
    # node1's stop; the bug waited node2's kill grace and agent slack on top (~20 s)
    assert ended_in < 8 + 5 + 8, ended_in
    assert "[node1:0]" in err and "no stacks from node2" in err
    assert "rank 1 on host node2 could not be confirmed stopped" in err, err
