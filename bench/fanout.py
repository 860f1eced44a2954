"""Fan-out and fail-fast of the SSH launcher on simulated hosts.

Builds its own cluster of network namespaces with sshd (tests/cluster/
simhosts.py; needs root) and measures, with the launcher in the root
namespace so that every host is reached over SSH:

1. start: from ``dsrun`` starting until every rank has run the first line
   of its script, for 1, 2 and 4 hosts with 1 rank each (median of
   ``--repeat`` runs); goal: 4 hosts <= 1.5x 1 host;
2. fail-fast: rank 0 on host A exits 1; time until the last process of the
   job on host B (its agent, guard and rank) is gone; goal < 5 s.

Ranks run with ``--dist_backend none`` (no torch import), so the numbers are
the launcher's own cost. All simulated hosts share this machine's CPUs, so
the bench also measures the CPU every job costs (the launcher's, and each
host's: sshd session, login shell, agent, guard, rank; read from the host
sshd's accumulated children time) and prints the CPU-bound floor
``total CPU / cores``: when it grows with the host count, the fan-out is
limited by the shared cores, not by the launcher serialising hosts.
Usage: ``python bench/fanout.py [--repeat N]``.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "cluster"))

from simhosts import SSHD_NAMES, SimCluster, preflight  # noqa: E402

WORKER = '''\
import os, sys, time
first = time.time()
out = sys.argv[1]
rank = os.environ["RANK"]
with open(os.path.join(out, "rank_" + rank), "w") as f:
    f.write(repr(first))
if len(sys.argv) > 2:  # fail-fast mode: rank 0 fails, the others wait
    if rank == "0":
        time.sleep(float(sys.argv[2]))
        with open(os.path.join(out, "failed"), "w") as f:
            f.write(repr(time.time()))
        sys.exit(1)
    time.sleep(60)
'''


def dsrun(cluster: SimCluster, hostfile: Path, *args: str) -> list[str]:
    return [sys.executable, "-m", "dsrun.launcher.cli", "-H", str(hostfile),
            "--ssh_config", cluster.ssh_config_path, "--dist_backend", "none", *args]


HZ = os.sysconf("SC_CLK_TCK")


def children_cpu(pid: int) -> float:
    """CPU seconds of the reaped descendants of ``pid`` (a host's sshd)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[13]) + int(fields[14])) / HZ


def own_children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def start_once(cluster: SimCluster, work: Path, worker: Path,
               hosts: int) -> tuple[float, float, float]:
    """(seconds until every rank ran its first line, until dsrun exited, CPU seconds)."""
    chosen = cluster.hosts[:hosts]
    hostfile = work / f"hostfile{hosts}"
    hostfile.write_text(cluster.hostfile_text(slots=1, hosts=[h.name for h in chosen]))
    out = Path(tempfile.mkdtemp(dir=work))
    cpu0 = own_children_cpu() + sum(children_cpu(h.sshd_pid) for h in chosen)
    t0 = time.time()
    res = subprocess.run(dsrun(cluster, hostfile, str(worker), str(out)), cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    total = time.time() - t0
    if res.returncode != 0:
        raise SystemExit(f"dsrun failed ({res.returncode}):\n{res.stderr}")
    time.sleep(0.3)  # let each sshd reap its session
    cpu = own_children_cpu() + sum(children_cpu(h.sshd_pid) for h in chosen) - cpu0
    firsts = [float((out / f"rank_{r}").read_text()) for r in range(hosts)]
    return max(firsts) - t0, total, cpu


def job_procs(cluster: SimCluster, host: str) -> list[int]:
    pids = []
    for pid in cluster.pids_in(host):
        try:
            proc = psutil.Process(pid)
            if proc.name() not in SSHD_NAMES and proc.status() != psutil.STATUS_ZOMBIE:
                pids.append(pid)
        except psutil.NoSuchProcess:
            continue
    return pids


def fail_fast_once(cluster: SimCluster, work: Path, worker: Path) -> float:
    """Seconds from rank 0's exit on node1 to the last job process on node2 gone."""
    hostfile = work / "hostfile-ff"
    hostfile.write_text(cluster.hostfile_text(slots=1, hosts=["node1", "node2"]))
    out = Path(tempfile.mkdtemp(dir=work))
    proc = subprocess.Popen(dsrun(cluster, hostfile, str(worker), str(out), "0.5"), cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        while not (out / "failed").exists():
            if proc.poll() is not None:
                raise SystemExit("dsrun exited before the failure")
            time.sleep(0.005)
        while job_procs(cluster, "node2"):
            time.sleep(0.005)
        gone = time.time()
        failed = float((out / "failed").read_text())
        proc.wait(timeout=30)
    finally:
        proc.kill()
        proc.wait()
    return gone - failed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    reason = preflight()
    if reason is not None:
        print(f"cannot build simulated hosts: {reason}")
        return 2
    with SimCluster(4) as cluster, tempfile.TemporaryDirectory(prefix="dsrun-fanout-") as tmp:
        work = Path(tmp)
        worker = work / "first_line.py"
        worker.write_text(WORKER)
        start_once(cluster, work, worker, 1)  # warm the page cache and sshd
        rows = []
        for hosts in (1, 2, 4):
            runs = [start_once(cluster, work, worker, hosts) for _ in range(args.repeat)]
            firsts = [r[0] for r in runs]
            rows.append((hosts, statistics.median(firsts), min(firsts), max(firsts),
                         statistics.median(r[1] for r in runs),
                         statistics.median(r[2] for r in runs)))
        fails = [fail_fast_once(cluster, work, worker) for _ in range(args.repeat)]
        cluster.wait_clean(5)
    cores = len(os.sched_getaffinity(0))
    print(f"dsrun SSH fan-out on simulated hosts ({cores} CPUs shared by all hosts, launcher "
          f"in the root namespace, 1 rank per host, median of {args.repeat})")
    print(f"{'hosts':>5}  {'start->all first lines':>22}  {'min':>6}  {'max':>6}  "
          f"{'dsrun total':>11}  {'CPU (all procs)':>15}  {'CPU/cores':>9}")
    for hosts, med, lo, hi, total, cpu in rows:
        print(f"{hosts:>5}  {med:>21.3f}s  {lo:>5.3f}s  {hi:>5.3f}s  {total:>10.3f}s  "
              f"{cpu:>14.3f}s  {cpu / cores:>8.3f}s")
    ratio = rows[-1][1] / rows[0][1]
    print(f"ratio 4 hosts / 1 host: {ratio:.2f}x (goal <= 1.5x)")
    extra_cpu = (rows[-1][5] - rows[0][5]) / cores
    print(f"  of the {rows[-1][1] - rows[0][1]:.3f}s that 3 more hosts add, {extra_cpu:.3f}s is "
          f"their CPU on the {cores} shared cores (a floor no launcher can beat here)")
    print(f"fail-fast: rank dies on node1 -> last job process on node2 gone: "
          f"median {statistics.median(fails):.3f}s, max {max(fails):.3f}s (goal < 5s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
