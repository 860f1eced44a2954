"""Tests of the simulated-hosts bench itself (tests/cluster/simhosts.py)."""

from __future__ import annotations

import os
import socket
import subprocess
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import paramiko
import psutil
import pytest
from simhosts import REGISTRY_DIR, SimCluster, SimClusterError, preflight

pytestmark = pytest.mark.cluster


@pytest.fixture
def can_build() -> None:
    reason = preflight()
    if reason is not None:
        pytest.skip(reason)


def _gone(proc: psutil.Process) -> bool:
    try:
        return not proc.is_running() or proc.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _leftovers(cluster: SimCluster) -> list[str]:
    """Names of this cluster's namespaces and links that still exist."""
    netns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    return [w for w in (netns + links).split() if w.startswith(f"dsr{cluster.tag}")
            or w.rstrip(":").split("@")[0] == cluster.bridge]


def _background(cluster: SimCluster, host: str, argv: str) -> int:
    """Start a shell command detached on host over ssh; return its PID."""
    res = cluster.ssh_run(host, ["sh", "-c", f"{argv} </dev/null >/dev/null 2>&1 & echo $!"],
                          check=True, timeout=30)
    return int(res.stdout)


def test_each_host_has_its_own_hostname(sim_cluster: SimCluster) -> None:
    with ThreadPoolExecutor(len(sim_cluster.hosts)) as pool:
        results = list(pool.map(lambda h: sim_cluster.ssh_run(h, ["hostname"]),
                                sim_cluster.hosts))
    assert [r.stdout.strip() for r in results] == [h.name for h in sim_cluster.hosts]
    assert socket.gethostname() not in [h.name for h in sim_cluster.hosts]


def test_hosts_resolve_each_other_to_bridge_addresses(sim_cluster: SimCluster) -> None:
    names = [h.name for h in sim_cluster.hosts]
    res = sim_cluster.ssh_run("node1", ["getent", "hosts", *names], check=True)
    resolved = {line.split()[1]: line.split()[0] for line in res.stdout.splitlines()}
    # Own name included: it must not resolve to 127.0.0.1 (gloo would bind loopback).
    assert resolved == {h.name: h.address for h in sim_cluster.hosts}


def test_hosts_reach_each_other_over_ssh(sim_cluster: SimCluster) -> None:
    res = sim_cluster.ssh_run("node1", sim_cluster.ssh_argv("node2", ["hostname"]))
    assert (res.returncode, res.stdout.strip()) == (0, "node2"), res.stderr


def test_paramiko_connects_with_known_hosts_and_key(sim_cluster: SimCluster) -> None:
    host = sim_cluster.host("node3")
    config = paramiko.SSHConfig.from_path(sim_cluster.ssh_config_path).lookup(host.name)
    assert config["hostname"] == host.address
    assert config["identityfile"] == [sim_cluster.key_path]
    # By name (socket made by hand: node names resolve only inside the hosts).
    sock = socket.create_connection((config["hostname"], 22), timeout=5)
    for name, kwargs in ((host.name, {"sock": sock}), (host.address, {})):
        with paramiko.SSHClient() as client:
            client.load_host_keys(sim_cluster.known_hosts_path)
            client.set_missing_host_key_policy(paramiko.RejectPolicy())
            client.connect(name, username=config["user"], key_filename=sim_cluster.key_path,
                           look_for_keys=False, allow_agent=False, timeout=5, **kwargs)
            _, out, _ = client.exec_command("hostname; echo $DSRUN_PROBE",
                                            environment={"DSRUN_PROBE": "through"})
            assert out.read().decode().split() == [host.name, "through"]


def test_paramiko_rejects_unknown_host_key(sim_cluster: SimCluster) -> None:
    with paramiko.SSHClient() as client:
        client.set_missing_host_key_policy(paramiko.RejectPolicy())
        with pytest.raises(paramiko.SSHException, match="not found in known_hosts"):
            client.connect(sim_cluster.hosts[0].address, username="root",
                           key_filename=sim_cluster.key_path, look_for_keys=False,
                           allow_agent=False, timeout=5)


def test_dev_shm_is_private_per_host(sim_cluster: SimCluster) -> None:
    path = f"/dev/shm/dsrun-simprobe-{uuid.uuid4().hex}"
    try:
        sim_cluster.ssh_run("node1", ["sh", "-c", f"echo x > {path} && test -e {path}"],
                            check=True)
        assert sim_cluster.ssh_run("node2", ["test", "-e", path]).returncode == 1
        assert not os.path.exists(path)
    finally:
        sim_cluster.ssh_run("node1", ["rm", "-f", path])


def test_nsenter_argv_runs_inside_host(sim_cluster: SimCluster) -> None:
    argv = sim_cluster.nsenter_argv("node4", ["sh", "-c", "hostname; getent hosts node4"])
    out = subprocess.run(argv, capture_output=True, text=True, check=True).stdout.split()
    assert out == ["node4", sim_cluster.host("node4").address, "node4"]


def test_hostfile_text(sim_cluster: SimCluster) -> None:
    assert sim_cluster.hostfile_text() == "".join(
        f"node{i} slots=2\n" for i in range(1, 5))
    assert sim_cluster.hostfile_text(slots=1, hosts=["node3", "node1"]) == (
        "node3 slots=1\nnode1 slots=1\n")


def test_leftover_is_reported_and_killed_by_pid(sim_cluster: SimCluster) -> None:
    sim_cluster.assert_clean()
    pid = _background(sim_cluster, "node2", "sleep 300")
    proc = psutil.Process(pid)
    assert pid in sim_cluster.pids_in("node2")
    assert sim_cluster.host("node2").sshd_pid not in sim_cluster.pids_in("node2")
    with pytest.raises(AssertionError, match=f"node2: pid {pid}: sleep 300"):
        sim_cluster.assert_clean()
    sim_cluster.kill_strays()
    assert _gone(proc)
    sim_cluster.assert_clean()


def test_stop_sshd_refuses_and_start_sshd_restores(sim_cluster: SimCluster) -> None:
    host = sim_cluster.host("node4")
    old_pid = host.sshd_pid
    sim_cluster.stop_sshd(host)
    try:
        assert host.sshd_pid is None
        t0 = time.monotonic()
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection((host.address, 22), timeout=5)
        res = sim_cluster.ssh_run(host, ["true"])
        assert res.returncode == 255 and "refused" in res.stderr, res.stderr
        assert time.monotonic() - t0 < 2.0
    finally:
        sim_cluster.start_sshd(host)
    assert host.sshd_pid not in (None, old_pid)
    assert sim_cluster.ssh_run(host, ["hostname"]).stdout.strip() == "node4"


@pytest.mark.usefixtures("can_build")
def test_teardown_kills_leftovers_and_removes_everything() -> None:
    with SimCluster(1) as cluster:
        workdir = cluster.workdir
        pid = _background(cluster, "node1", "sleep 300")
        proc = psutil.Process(pid)
        with pytest.raises(AssertionError, match=f"pid {pid}: sleep 300"):
            cluster.assert_clean()
        assert _leftovers(cluster)
    assert _gone(proc)
    assert _leftovers(cluster) == []
    assert workdir is not None and not workdir.exists()
    assert not (REGISTRY_DIR / f"{cluster.tag}.json").exists()
    cluster.teardown()  # idempotent


@pytest.mark.usefixtures("can_build")
def test_failed_start_leaves_nothing() -> None:
    cluster = SimCluster(2, sshd="/bin/false")
    with pytest.raises(SimClusterError, match="sshd of node1 exited"):
        cluster.start()
    assert cluster.tag and _leftovers(cluster) == []
    assert cluster.workdir is None
    assert not (REGISTRY_DIR / f"{cluster.tag}.json").exists()
