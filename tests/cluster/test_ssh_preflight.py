"""``dsrun doctor`` and the preflight of a multi-host launch on simulated hosts.

A host that cannot run the job must be named, fail fast, and no rank may
start anywhere.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from simhosts import SimCluster
from sshjobs import BEHAVE, run, ssh_flags, write_hostfile

pytestmark = pytest.mark.cluster


def test_doctor_passes_on_healthy_hosts(sim_cluster: SimCluster, tmp_path: Path) -> None:
    hostfile = write_hostfile(sim_cluster, tmp_path / "hostfile",
                              ["node1", "node2", "node3"], slots=2)
    res = run(sim_cluster, "doctor", "-H", hostfile, *ssh_flags(sim_cluster))
    assert res.returncode == 0, res.stdout + res.stderr
    lines = {ln.split()[0]: ln for ln in res.stdout.splitlines() if ln.startswith("  node")}
    master = sim_cluster.host("node1").address
    assert "ok" in lines["node1"] and f"master {master}:" in lines["node1"]
    for host in ("node2", "node3"):
        assert " ok " in lines[host] and f"reaches master {master}:" in lines[host]
        assert "via eth0" in lines[host] and "torch " in lines[host]
    assert "all 3 host(s) ok" in res.stdout


def test_host_with_sshd_down_is_named_and_nothing_starts(sim_cluster: SimCluster,
                                                         tmp_path: Path) -> None:
    hostfile = write_hostfile(sim_cluster, tmp_path / "hostfile",
                              ["node2", "node3", "node4"], slots=1)
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()
    sim_cluster.stop_sshd("node4")
    try:
        start = time.monotonic()
        doctor = run(sim_cluster, "doctor", "-H", hostfile, *ssh_flags(sim_cluster))
        doctor_s = time.monotonic() - start
        start = time.monotonic()
        job = run(sim_cluster, "-H", hostfile, *ssh_flags(sim_cluster), "--dist_backend",
                  "none", BEHAVE, "--pid_dir", str(pid_dir))
        job_s = time.monotonic() - start
    finally:
        sim_cluster.start_sshd("node4")
    addr = sim_cluster.host("node4").address
    assert doctor.returncode == 1, doctor.stdout + doctor.stderr
    assert f"node4  FAIL  node4: connection refused by {addr}:22 (is sshd running there?)" \
        in doctor.stdout
    assert doctor.stderr.strip() == "dsrun: error: 1 of 3 host(s) failed: node4"
    assert job.returncode == 1, job.stderr
    err = job.stderr.strip().splitlines()
    assert err[-1].startswith("dsrun: error: preflight failed on node4: no rank was started")
    assert f"connection refused by {addr}:22" in job.stderr
    assert list(pid_dir.iterdir()) == []  # no rank ran anywhere
    assert doctor_s < 5 and job_s < 5, (doctor_s, job_s)


def test_unknown_host_key_is_refused_with_the_fix(sim_cluster: SimCluster,
                                                  tmp_path: Path) -> None:
    empty = tmp_path / "known_hosts"
    empty.write_text("")
    config = tmp_path / "ssh_config"
    config.write_text(Path(sim_cluster.ssh_config_path).read_text().replace(
        sim_cluster.known_hosts_path, str(empty)))
    hostfile = write_hostfile(sim_cluster, tmp_path / "hostfile", ["node2"], slots=1)
    res = run(sim_cluster, "doctor", "-H", hostfile, "--ssh_config", str(config))
    assert res.returncode == 1
    addr = sim_cluster.host("node2").address
    assert f"node2: host key of {addr}:22 is not in known_hosts ({empty})" in res.stdout
    assert f"`ssh-keyscan -H {addr} >> {empty}`" in res.stdout
    assert "--ssh_insecure" in res.stdout and "SHA256:" in res.stdout
    res = run(sim_cluster, "doctor", "-H", hostfile, "--ssh_config", str(config),
              "--ssh_insecure")
    assert res.returncode == 0, res.stdout + res.stderr
    assert empty.read_text() == ""  # an accepted key is never saved


def test_working_directory_missing_on_a_host(sim_cluster: SimCluster, tmp_path: Path) -> None:
    # A directory that exists only in node1's mount namespace (a tmpfs there).
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    only_here = mnt / "only-on-node1"
    in_node1 = sim_cluster.nsenter_argv
    subprocess.run(in_node1("node1", ["sh", "-c", f"mount -t tmpfs tmpfs {mnt} && "
                                                  f"mkdir {only_here}"]), check=True)
    try:
        hostfile = write_hostfile(sim_cluster, tmp_path / "hostfile", ["node1", "node2"],
                                  slots=1)
        doctor = run(sim_cluster, "doctor", "-H", hostfile, *ssh_flags(sim_cluster),
                     on="node1", cwd=only_here)
        job = run(sim_cluster, "-H", hostfile, *ssh_flags(sim_cluster), "--dist_backend",
                  "none", BEHAVE, on="node1", cwd=only_here)
    finally:
        subprocess.run(in_node1("node1", ["umount", str(mnt)]), check=True)
    message = f"working directory {only_here} does not exist on node2"
    assert doctor.returncode == 1 and message in doctor.stdout, doctor.stdout
    assert job.returncode == 1 and message in job.stderr, job.stderr


def test_hung_host_fails_within_ssh_timeout(sim_cluster: SimCluster, tmp_path: Path) -> None:
    # A stopped sshd still completes TCP handshakes (the kernel does) but never
    # answers: the worst case, a host that hangs instead of refusing.
    hostfile = write_hostfile(sim_cluster, tmp_path / "hostfile", ["node2", "node3"], slots=1)
    sshd = sim_cluster.host("node3").sshd_pid
    assert sshd is not None
    os.kill(sshd, signal.SIGSTOP)
    try:
        start = time.monotonic()
        res = run(sim_cluster, "doctor", "-H", hostfile, *ssh_flags(sim_cluster),
                  "--ssh_timeout", "1.5")
        elapsed = time.monotonic() - start
    finally:
        os.kill(sshd, signal.SIGCONT)
    addr = sim_cluster.host("node3").address
    assert res.returncode == 1
    assert f"node3  FAIL  node3: no SSH answer from {addr}:22 within 1.5s (--ssh_timeout)" \
        in res.stdout, res.stdout
    assert " ok " in next(ln for ln in res.stdout.splitlines() if "node2" in ln)
    assert elapsed < 1.5 + 2.5, elapsed
