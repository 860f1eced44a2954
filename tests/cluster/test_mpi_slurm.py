"""``--launcher openmpi`` across simulated hosts, and ``--launcher slurm`` on a real Slurm.

Open MPI: the launcher runs on node1 (inside its namespaces); mpirun starts
node2's agents over ssh with the bench's ssh_config, which dsrun passes on
as ``--mca plm_rsh_args``.

Slurm: slurmctld, munged and one slurmd per host of a 2-host cluster of its
own (slurmhosts.py); dsrun and srun run in the root namespace, like a
login node. Every test is also checked by the autouse fixtures: nothing of
the job may be left on any host, and no Slurm job may be left.
"""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from simhosts import SimCluster
from slurmhosts import SlurmCluster
from sshjobs import BEHAVE, ROOT, WORKERS, run, ssh_flags, wait_files, write_hostfile

from tests.conftest import wait_gone

pytestmark = pytest.mark.cluster
DSRUN = [sys.executable, "-m", "dsrun.launcher.cli"]
CPU = ["--cpu"]  # ranks of these tests are CPU ranks (gloo), also on a GPU host
PI_TORCH = str(ROOT / "examples" / "mpi_pi" / "pi_torch.py")


# -- Open MPI across two simulated hosts ------------------------------------------------


def test_openmpi_two_hosts_two_ranks_each(sim_cluster: SimCluster, tmp_path: Path) -> None:
    hostfile = write_hostfile(sim_cluster, tmp_path / "hostfile", ["node1", "node2"], slots=2)
    res = run(sim_cluster, "--launcher", "openmpi", "-H", hostfile, *ssh_flags(sim_cluster),
              *CPU, str(WORKERS / "allreduce.py"), on="node1", timeout=180)
    assert res.returncode == 0, res.stdout + res.stderr
    for rank, host in [(0, "node1"), (1, "node1"), (2, "node2"), (3, "node2")]:
        assert f"[{host}:{rank}] rank {rank}/4 backend gloo sum 10" in res.stdout, res.stdout
    assert "node2: ranks [2,3]  local ranks [0,1]  devices [cpu]" in res.stderr
    assert f"master {sim_cluster.host('node1').address}:" in res.stderr


def test_openmpi_keeps_the_hostfile_order_when_this_host_is_not_first(
        sim_cluster: SimCluster, tmp_path: Path) -> None:
    """Open MPI maps its own host first under -H host:n --map-by slot: node2's
    rank ran on node1, and uneven slots were refused. dsrun's plan order
    holds (rank 0 and the master on node2)."""
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("node2 slots=1\nnode1 slots=2\n")
    res = run(sim_cluster, "--launcher", "openmpi", "-H", str(hostfile),
              *ssh_flags(sim_cluster), *CPU, str(WORKERS / "allreduce.py"), on="node1",
              timeout=180)
    assert res.returncode == 0, res.stdout + res.stderr
    for rank, host in [(0, "node2"), (1, "node1"), (2, "node1")]:
        assert f"[{host}:{rank}] rank {rank}/3 backend gloo sum 6" in res.stdout, res.stdout
    assert "node1: ranks [1,2]  local ranks [0,1]  devices [cpu]" in res.stderr
    assert f"master {sim_cluster.host('node2').address}:" in res.stderr


def test_openmpi_rank_failure_on_the_remote_host(sim_cluster: SimCluster,
                                                 tmp_path: Path) -> None:
    hostfile = write_hostfile(sim_cluster, tmp_path / "hostfile", ["node1", "node2"], slots=2)
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()
    res = run(sim_cluster, "--launcher", "openmpi", "-H", hostfile, *ssh_flags(sim_cluster),
              *CPU, "--dist_backend", "none", "--kill_grace", "1", BEHAVE, "--pid_dir",
              str(pid_dir), "--fail_rank", "3", "--code", "9", "--delay", "1",
              "--grandchild", "setsid", on="node1", timeout=120)
    assert res.returncode == 9, res.stderr
    assert "job failed: rank 3 on host node2 failed first: exit code 9" in res.stderr
    pids = wait_files(pid_dir, 8, 1)
    assert wait_gone(list(pids.values()), 15) == []  # a leak would live 60-120 s


# -- Slurm ------------------------------------------------------------------------------


def _slurm(slurm: SlurmCluster, *args: str, timeout: float = 180,
           prefix: tuple[str, ...] = ()) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*prefix, *DSRUN, "--launcher", "slurm", *args], env=slurm.env(),
                          capture_output=True, text=True, timeout=timeout, cwd=str(ROOT))


def test_slurm_job_outside_an_allocation(slurm_cluster: SlurmCluster) -> None:
    res = _slurm(slurm_cluster, *CPU, "--slurm_args", "--time=5", "--num_nodes", "2",
                 "--num_gpus", "2", str(WORKERS / "allreduce.py"))
    assert res.returncode == 0, res.stdout + res.stderr
    found = sorted(re.findall(r"^\[(node\d):(\d)\] rank \2/4 backend gloo sum 10$",
                              res.stdout, re.M))
    # srun chose the nodes; the agents named them; ranks 0,1 share one, 2,3 the other
    assert len(found) == 4 and found[0][0] == found[1][0] != found[2][0] == found[3][0]


def test_slurm_job_inside_salloc_runs_ranks_where_planned(slurm_cluster: SlurmCluster,
                                                          tmp_path: Path) -> None:
    hostfile = tmp_path / "hostfile"  # node2 first: srun must follow the plan's order
    hostfile.write_text("node2 slots=1\nnode1 slots=2\n")
    res = _slurm(slurm_cluster, "-H", str(hostfile), *CPU, PI_TORCH, "--samples", "20000000",
                 prefix=("salloc", "--nodes=2", "--ntasks-per-node=2", "--time=5"))
    assert res.returncode == 0, res.stdout + res.stderr
    assert "node2: ranks [0]  local ranks [0]  devices [cpu]" in res.stderr
    assert "node1: ranks [1,2]  local ranks [0,1]  devices [cpu]" in res.stderr
    match = re.search(r"^\[node2:0\] pi ~ [0-9.]+, error ([0-9.e-]+) .*3 rank\(s\)",
                      res.stdout, re.M)
    assert match and float(match.group(1)) < 1e-3, res.stdout


def test_slurm_rank_failure_stops_every_host(slurm_cluster: SlurmCluster,
                                             tmp_path: Path) -> None:
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()
    res = _slurm(slurm_cluster, *CPU, "--slurm_args", "--time=5", "--num_nodes", "2",
                 "--num_gpus", "2", "--dist_backend", "none", "--kill_grace", "1", BEHAVE,
                 "--pid_dir", str(pid_dir), "--fail_rank", "2", "--code", "5", "--delay", "1",
                 "--grandchild", "setsid")
    assert res.returncode == 5, res.stderr
    assert re.search(r"job failed: rank 2 on host node\d failed first: exit code 5",
                     res.stderr), res.stderr
    pids = wait_files(pid_dir, 8, 1)
    assert wait_gone(list(pids.values()), 15) == []  # a leak would live 60-120 s


def test_ctrl_c_stops_a_slurm_job(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()
    proc = subprocess.Popen([*DSRUN, "--launcher", "slurm", *CPU, "--slurm_args", "--time=5",
                             "--num_nodes", "2", "--num_gpus", "1", "--dist_backend", "none",
                             "--kill_grace", "1", BEHAVE, "--pid_dir", str(pid_dir),
                             "--grandchild", "setsid"], env=slurm_cluster.env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=str(ROOT))
    try:
        pids = wait_files(pid_dir, 4, 60)
        proc.send_signal(signal.SIGINT)
        start = time.monotonic()
        _, err = proc.communicate(timeout=30)
        assert wait_gone(list(pids.values()), 5) == []
        assert time.monotonic() - start < 15
    finally:
        proc.kill()
    assert proc.returncode == 130, err
    assert "stopped by SIGINT; every rank was stopped" in err


def test_srun_by_hand_finds_rank_and_master_from_slurm(slurm_cluster: SlurmCluster) -> None:
    res = subprocess.run(["srun", "--nodes=2", "--ntasks-per-node=1", "--time=5",
                          sys.executable, str(WORKERS / "init_distributed.py")],
                         env=slurm_cluster.env(), capture_output=True, text=True, timeout=180,
                         cwd=str(ROOT))
    assert res.returncode == 0, res.stdout + res.stderr
    assert sorted(re.findall(r"rank (\d)/2 from Slurm sum 3", res.stdout)) == ["0", "1"]
    # exported after the discovery, as DeepSpeed's init_distributed does
    found = re.findall(r"^rank (\d) environ RANK=\1 LOCAL_RANK=0 WORLD_SIZE=2 "
                       r"MASTER_ADDR=(node\d) MASTER_PORT=(\d+)$", res.stdout, re.M)
    assert len(found) == 2 and found[0][1:] == found[1][1:], res.stdout


def test_dsrun_outside_an_allocation_needs_slurm_args(slurm_cluster: SlurmCluster) -> None:
    res = _slurm(slurm_cluster, *CPU, "--dist_backend", "none", BEHAVE)
    assert res.returncode == 2
    assert res.stderr.startswith("dsrun: error: --launcher slurm outside an allocation")
    assert slurm_cluster.jobs() == []
