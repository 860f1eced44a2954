"""Hosts reachable only through another host, as behind a login node or
bastion: ssh_config ProxyJump and ProxyCommand on the simulated cluster.

The job's host is named by an alias whose HostName is ``node2``: that name
resolves inside the simulated hosts (their /etc/hosts) but not where the
launcher runs (the root namespace), so only a connection that node1 makes
on our behalf reaches it. The aliases live in a config of the test's own
that Includes the bench's ssh_config (its key and known_hosts). The
autouse leak check of conftest.py checks that nothing is left on any host;
the test checks that no ProxyCommand (``ssh -W``) outlives the job.
"""

from __future__ import annotations

import socket
import time
from pathlib import Path

import psutil
import pytest
from simhosts import SimCluster
from sshjobs import WORKERS, run

pytestmark = pytest.mark.cluster

WHERE = "import socket\nprint('on', socket.gethostname(), flush=True)\n"


def _config(cluster: SimCluster, tmp_path: Path) -> str:
    common = (f"    User root\n    IdentityFile {cluster.key_path}\n    IdentitiesOnly yes\n"
              f"    UserKnownHostsFile {cluster.known_hosts_path}\n"
              "    GlobalKnownHostsFile /dev/null\n    StrictHostKeyChecking yes\n")
    path = tmp_path / "ssh_config"
    path.write_text(
        f"Include {cluster.ssh_config_path}\n\n"
        f"Host via-jump\n    HostName node2\n    ProxyJump root@node1:22\n{common}\n"
        f"Host via-cmd\n    HostName node2\n"
        f"    ProxyCommand ssh -F {cluster.ssh_config_path} -W %h:%p node1\n{common}")
    return str(path)


def _proxies_of(config: str) -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        cmdline = proc.info["cmdline"] or []
        if any(config in part for part in cmdline[1:]) and "-W" in cmdline:
            found.append(proc)
    return found


@pytest.mark.parametrize("alias", ["via-jump", "via-cmd"])
def test_a_rank_runs_on_a_host_behind_another(alias: str, sim_cluster: SimCluster,
                                              tmp_path: Path) -> None:
    with pytest.raises(OSError):  # not reachable without the proxy
        socket.getaddrinfo("node2", 22)
    config = _config(sim_cluster, tmp_path)
    (tmp_path / "hostfile").write_text(f"{alias} slots=1\n")
    (tmp_path / "where.py").write_text(WHERE)
    res = run(sim_cluster, "-H", str(tmp_path / "hostfile"), "--ssh_config", config,
              "--dist_backend", "none", str(tmp_path / "where.py"), timeout=120)
    assert res.returncode == 0, res.stderr
    assert "[node2:0] on node2" in res.stdout, res.stdout + res.stderr
    assert f"{alias} (node2): ranks [0]" in res.stderr
    deadline = time.monotonic() + 5
    while _proxies_of(sim_cluster.ssh_config_path) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _proxies_of(sim_cluster.ssh_config_path) == []


def test_allreduce_over_two_hosts_behind_one_jump_host(sim_cluster: SimCluster,
                                                       tmp_path: Path) -> None:
    """Both hosts only through node1 (a connection each, as ssh -J makes);
    the ranks then talk to each other directly, inside the cluster."""
    common = (f"    ProxyJump node1\n    User root\n    IdentityFile {sim_cluster.key_path}\n"
              f"    UserKnownHostsFile {sim_cluster.known_hosts_path}\n")
    config = tmp_path / "ssh_config"
    config.write_text(f"Include {sim_cluster.ssh_config_path}\n\n"
                      f"Host b2\n    HostName node2\n{common}\n"
                      f"Host b3\n    HostName node3\n{common}")
    (tmp_path / "hostfile").write_text("b2 slots=1\nb3 slots=1\n")
    res = run(sim_cluster, "-H", str(tmp_path / "hostfile"), "--ssh_config", str(config),
              str(WORKERS / "allreduce.py"), timeout=120)
    assert res.returncode == 0, res.stderr
    for rank, host in [(0, "node2"), (1, "node3")]:
        assert f"[{host}:{rank}] rank {rank}/2 backend gloo sum 3" in res.stdout, res.stdout


def test_an_unreachable_jump_target_is_named(sim_cluster: SimCluster, tmp_path: Path) -> None:
    config = tmp_path / "ssh_config"
    config.write_text(f"Include {sim_cluster.ssh_config_path}\n\n"
                      "Host ghost\n    HostName node2\n    Port 2999\n    ProxyJump node1\n"
                      f"    User root\n    IdentityFile {sim_cluster.key_path}\n")
    (tmp_path / "hostfile").write_text("ghost slots=1\n")
    res = run(sim_cluster, "doctor", "-H", str(tmp_path / "hostfile"), "--ssh_config",
              str(config), timeout=60)
    assert res.returncode != 0
    assert "ghost: ProxyJump host node1 cannot reach node2:2999" in res.stdout + res.stderr
