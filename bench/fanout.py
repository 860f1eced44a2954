"""Fan-out, per-host cost and fail-fast of the SSH launcher on simulated hosts.

Builds its own cluster of network namespaces with sshd (tests/cluster/
simhosts.py; needs root) and measures, with the launcher in the root
namespace so that every host is reached over SSH, 1 rank per host, ranks
with ``--dist_backend none`` (no torch import):

1. start: from ``dsrun`` starting until every rank has run the first line
   of its script, for each host count (median of ``--repeat`` runs);
   goals: 4 hosts <= 1.5x and 32 hosts <= 4x the 1-host time;
2. CPU per host: the launcher's own CPU (from wait4), and each host's
   (read from the host sshd's accumulated children time: the SSH session,
   the login shell, the node agent and its guard, the rank), less the
   rank's own CPU (the rank reports it) = what dsrun costs on a host; and
   an SSH session running ``true``, the part no launcher can save; goal:
   <= 0.15 s of dsrun CPU per host;
3. agent memory and CPU: the largest RSS of a node agent during a run, and
   each agent's own CPU (both sampled every 20 ms); goal: <= 40 MB;
4. fail-fast (2 hosts and the largest count, if 2 or more): rank 0 exits 1; time until
   the last process of the job on the other hosts is gone (goal < 5 s), and
   that nothing of the job is left anywhere; and Ctrl-C at the largest
   count leaves nothing behind.

All simulated hosts share this machine's CPUs, so the start time grows with
the total CPU a job needs; the bench prints the CPU-bound floor ``total CPU
/ cores`` beside each time. Usage: ``python bench/fanout.py [--repeat N]
[--hosts 1,2,4,8,16,32]``.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
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
if len(sys.argv) > 2:  # fail-fast mode: rank 0 fails, the others wait
    open(os.path.join(out, "rank_" + rank), "w").write(repr(first))
    if rank == "0":
        time.sleep(float(sys.argv[2]))
        with open(os.path.join(out, "failed"), "w") as f:
            f.write(repr(time.time()))
        sys.exit(1)
    time.sleep(60)
t = os.times()
with open(os.path.join(out, "rank_" + rank), "w") as f:
    f.write(f"{first!r} {t.user + t.system!r}")
'''
HZ = os.sysconf("SC_CLK_TCK")


def dsrun(cluster: SimCluster, hostfile: Path, *args: str) -> list[str]:
    return [sys.executable, "-m", "dsrun.launcher.cli", "-H", str(hostfile),
            "--ssh_config", cluster.ssh_config_path, "--dist_backend", "none", *args]


def children_cpu(pid: int) -> float:
    """CPU seconds of the reaped descendants of ``pid`` (a host's sshd)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[13]) + int(fields[14])) / HZ


def hosts_cpu(cluster: SimCluster, hosts: int) -> float:
    return sum(children_cpu(h.sshd_pid) for h in cluster.hosts[:hosts] if h.sshd_pid)


def write_hostfile(cluster: SimCluster, work: Path, hosts: int) -> Path:
    path = work / f"hostfile{hosts}"
    path.write_text(cluster.hostfile_text(slots=1, hosts=[h.name for h in
                                                          cluster.hosts[:hosts]]))
    return path


@dataclass
class Start:
    first_lines: float  # seconds until every rank ran its first line
    total: float  # seconds until dsrun exited
    launcher_cpu: float
    hosts_cpu: float  # everything on the hosts, ranks included
    ranks_cpu: float


def start_once(cluster: SimCluster, work: Path, worker: Path, hosts: int) -> Start:
    hostfile = write_hostfile(cluster, work, hosts)
    out = Path(tempfile.mkdtemp(dir=work))
    cpu0 = hosts_cpu(cluster, hosts)
    t0 = time.time()
    proc = subprocess.Popen(dsrun(cluster, hostfile, str(worker), str(out)), cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    assert proc.stderr is not None
    err = proc.stderr.read()
    _, status, usage = os.wait4(proc.pid, 0)
    total = time.time() - t0
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise SystemExit(f"dsrun failed ({proc.returncode}):\n{err}")
    time.sleep(0.3)  # let each sshd reap its session
    ranks = [(out / f"rank_{r}").read_text().split() for r in range(hosts)]
    return Start(max(float(r[0]) for r in ranks) - t0, total, usage.ru_utime + usage.ru_stime,
                 hosts_cpu(cluster, hosts) - cpu0, sum(float(r[1]) for r in ranks))


def ssh_true_cpu(cluster: SimCluster, runs: int = 5) -> float:
    """Host CPU of an SSH session that runs ``true``: sshd and the login shell."""
    costs = []
    for _ in range(runs):
        before = hosts_cpu(cluster, 1)
        subprocess.run(cluster.ssh_argv(cluster.hosts[0], ["true"]), check=True,
                       capture_output=True)
        time.sleep(0.3)
        costs.append(hosts_cpu(cluster, 1) - before)
    return statistics.median(costs)


def agent_usage(cluster: SimCluster, work: Path, worker: Path,
                hosts: int) -> tuple[float, float]:
    """(largest RSS in MB of any node agent, median CPU seconds per agent)
    while a job runs, sampled."""
    peak = [0]
    cpu: dict[tuple[int, float], float] = {}
    done = threading.Event()
    begin = time.time()

    def sample() -> None:
        attrs = ["name", "cmdline", "memory_info", "cpu_times", "create_time"]
        while not done.is_set():
            for proc in psutil.process_iter(attrs):
                try:
                    info = proc.info
                    if "dsrun.launcher.agent" in " ".join(info["cmdline"] or ()) \
                            and info["name"] != "dsrun-guard" and info["create_time"] > begin:
                        peak[0] = max(peak[0], info["memory_info"].rss)
                        t = info["cpu_times"]
                        cpu[(proc.pid, info["create_time"])] = t.user + t.system
                except (psutil.Error, TypeError):
                    continue
            time.sleep(0.02)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        hostfile = write_hostfile(cluster, work, hosts)
        out = Path(tempfile.mkdtemp(dir=work))
        subprocess.run(dsrun(cluster, hostfile, str(worker), str(out), "0.5"), cwd=ROOT,
                       capture_output=True, timeout=120)
    finally:
        done.set()
        sampler.join()
    # the first sample of a forked guard (before it renames itself) counts
    # as an agent with next to no CPU: keep the busiest sample per host
    per_agent = sorted(cpu.values(), reverse=True)[:hosts]
    return peak[0] / 2**20, statistics.median(per_agent) if per_agent else 0.0


def job_procs(cluster: SimCluster, hosts: list[str]) -> list[int]:
    pids = []
    for host in hosts:
        for pid in cluster.pids_in(host):
            try:
                proc = psutil.Process(pid)
                if proc.name() not in SSHD_NAMES and proc.status() != psutil.STATUS_ZOMBIE:
                    pids.append(pid)
            except psutil.NoSuchProcess:
                continue
    return pids


def fail_fast_once(cluster: SimCluster, work: Path, worker: Path, hosts: int) -> float:
    """Seconds from rank 0's exit on node1 to the last job process elsewhere gone."""
    hostfile = write_hostfile(cluster, work, hosts)
    out = Path(tempfile.mkdtemp(dir=work))
    others = [h.name for h in cluster.hosts[1:hosts]]
    proc = subprocess.Popen(dsrun(cluster, hostfile, str(worker), str(out), "0.5"), cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        while not (out / "failed").exists():
            if proc.poll() is not None:
                raise SystemExit("dsrun exited before the failure")
            time.sleep(0.005)
        while job_procs(cluster, others):
            time.sleep(0.005)
        gone = time.time()
        failed = float((out / "failed").read_text())
        proc.wait(timeout=60)
    finally:
        proc.kill()
        proc.wait()
    cluster.wait_clean(5)
    return gone - failed


def ctrl_c_once(cluster: SimCluster, work: Path, worker: Path, hosts: int) -> float:
    """SIGINT to dsrun once every rank runs; seconds until nothing is left."""
    hostfile = write_hostfile(cluster, work, hosts)
    out = Path(tempfile.mkdtemp(dir=work))
    proc = subprocess.Popen(dsrun(cluster, hostfile, str(worker), str(out), "60"), cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        while len(list(out.glob("rank_*"))) < hosts:
            time.sleep(0.02)
        proc.send_signal(signal.SIGINT)
        start = time.time()
        proc.wait(timeout=60)
        names = [h.name for h in cluster.hosts[:hosts]]
        while job_procs(cluster, names):
            time.sleep(0.02)
        took = time.time() - start
    finally:
        proc.kill()
        proc.wait()
    cluster.wait_clean(5)
    if proc.returncode != 130:
        raise SystemExit(f"dsrun exited {proc.returncode} after SIGINT")
    return took


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--hosts", default="1,2,4,8,16,32")
    args = parser.parse_args()
    counts = sorted({int(n) for n in args.hosts.split(",")})
    reason = preflight()
    if reason is not None:
        print(f"cannot build simulated hosts: {reason}")
        return 2
    load_before = os.getloadavg()
    with SimCluster(max(counts)) as cluster, \
            tempfile.TemporaryDirectory(prefix="dsrun-fanout-") as tmp:
        work = Path(tmp)
        worker = work / "first_line.py"
        worker.write_text(WORKER)
        start_once(cluster, work, worker, 1)  # warm the page cache and sshd
        rows = {}
        for _ in range(args.repeat):  # interleaved: load drifts hit every count alike
            for hosts in counts:
                rows.setdefault(hosts, []).append(start_once(cluster, work, worker, hosts))
        ssh_true = ssh_true_cpu(cluster)
        rss, agent_cpu = agent_usage(cluster, work, worker, max(counts))
        # a rank failing on node1 needs another host to watch: 2 hosts at least
        fails = {n: [fail_fast_once(cluster, work, worker, n) for _ in range(3)]
                 for n in sorted({min(2, max(counts)), max(counts)}) if n >= 2}
        ctrl_c = ctrl_c_once(cluster, work, worker, max(counts))
        cluster.wait_clean(5)
    report(counts, rows, ssh_true, (rss, agent_cpu), fails, ctrl_c, args.repeat, load_before)
    return 0


def report(counts: list[int], rows: dict[int, list[Start]], ssh_true: float,
           agent: tuple[float, float],
           fails: dict[int, list[float]], ctrl_c: float, repeat: int,
           load_before: tuple[float, float, float]) -> None:
    cores = len(os.sched_getaffinity(0))
    med = {n: {k: statistics.median(getattr(s, k) for s in rows[n])
               for k in ("first_lines", "total", "launcher_cpu", "hosts_cpu", "ranks_cpu")}
           for n in counts}
    print(f"dsrun SSH fan-out on simulated hosts ({cores} CPUs shared by all hosts, launcher "
          f"in the root namespace, 1 rank per host, median of {repeat}; load average before "
          f"{load_before[0]:.1f}, after {os.getloadavg()[0]:.1f})")
    vs = f"vs {counts[0]} host{'s' if counts[0] > 1 else ''}"
    wide = max(9, len(vs))  # "vs 4 hosts" is 10 characters
    print(f"{'hosts':>5}  {'all first lines':>15}  {vs:>{wide}}  {'dsrun total':>11}  "
          f"{'launcher CPU/host':>17}  {'dsrun CPU/host':>14}  {'all CPU/cores':>13}")
    base = med[counts[0]]["first_lines"]
    for n in counts:
        m = med[n]
        dsrun_host = (m["hosts_cpu"] - m["ranks_cpu"] + m["launcher_cpu"]) / n
        floor = (m["hosts_cpu"] + m["launcher_cpu"]) / cores
        print(f"{n:>5}  {m['first_lines']:>14.3f}s  {m['first_lines'] / base:>{wide - 1}.2f}x  "
              f"{m['total']:>10.3f}s  {m['launcher_cpu'] / n:>16.3f}s  {dsrun_host:>13.3f}s  "
              f"{floor:>12.3f}s")
    print("goals: 4 hosts <= 1.5x, 32 hosts <= 4x the 1-host time; <= 0.15 s of dsrun CPU "
          "per host" + ("" if counts[0] == 1 else f" (the ratios above are to {counts[0]} "
                        "hosts: add 1 to --hosts for the goals' baseline)"))
    print(f"dsrun CPU/host = the launcher's share + the host's CPU less the rank's own "
          f"({statistics.median(s.ranks_cpu / n for n in counts for s in rows[n]):.3f}s per "
          f"rank); of it, an SSH session running `true` costs {ssh_true:.3f}s (sshd and "
          f"the login shell)")
    print(f"node agents during a {max(counts)}-host job: largest RSS {agent[0]:.1f} MB (goal "
          f"<= 40 MB); own CPU {agent[1]:.3f}s each (median, sampled)")
    if not fails:
        print("fail-fast: not measured (it needs 2 hosts or more in --hosts)")
    for n, times in fails.items():
        print(f"fail-fast, {n} hosts: rank dies on node1 -> last job process elsewhere gone: "
              f"median {statistics.median(times):.3f}s, max {max(times):.3f}s (goal < 5s); "
              f"nothing left")
    print(f"Ctrl-C, {max(counts)} hosts: every job process gone {ctrl_c:.3f}s after SIGINT; "
          f"nothing left")


if __name__ == "__main__":
    sys.exit(main())
