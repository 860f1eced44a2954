"""A real Slurm on simulated hosts: munged, slurmctld, and one slurmd per host.

:class:`SlurmCluster` starts, from Debian's packages (``slurmctld``,
``slurmd``, ``slurm-client``, ``munge``):

- one ``munged`` with a fresh key and its own socket (never the system's);
- ``slurmctld`` in the root network namespace, listening on the bridge
  address of a :class:`simhosts.SimCluster`;
- one ``slurmd`` inside each simulated host's namespaces (so its host name
  is the node name, and tasks run "on" that host), registered as
  ``NodeName=nodeN NodeAddr=<its address>``;

all configured by one ``slurm.conf`` in a temp dir (``SLURM_CONF`` points
clients at it: :meth:`SlurmCluster.env`). Processes are tracked by PID and
stopped by PID at teardown. Each run records its owner and its daemons
(PID and start time) in ``run.json`` in its temp dir; a new run first ends
the daemons of runs whose owner is gone (a test session stopped by a
signal), as :class:`simhosts.SimCluster` does for its namespaces. The
leak check of the hosts ignores ``slurmd`` (a service, like sshd) but not
``slurmstepd`` or anything a job left.

Plugins are the ones that need no cgroup setup or accounting: proctrack
linuxproc, task none, select cons_tres with CR_CPU, no accounting storage.
On a host whose /sys/fs/cgroup is the cgroup v1 layout (tmpfs), slurmd is
told to use the v1 plugin (autodetection fails there).

:func:`slurm_preflight` says why a SlurmCluster cannot be built here (None
when it can): missing binaries, or not root.
"""

from __future__ import annotations

import glob
import json
import logging
import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Optional

import psutil
from simhosts import SimCluster, kill_procs, owner_alive, owner_record, same_process

log = logging.getLogger(__name__)

BINARIES = ("munged", "slurmctld", "slurmd", "srun", "sinfo", "salloc")
CPUS_PER_NODE = 4


def slurm_preflight() -> Optional[str]:
    if os.geteuid() != 0:
        return "a test Slurm needs root"
    for name in BINARIES:
        if shutil.which(name) is None:
            return (f"{name} not found: a real Slurm needs Debian's slurmctld, slurmd, "
                    f"slurm-client and munge (scripts/install.sh installs them as root)")
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


def _cgroup_conf() -> str:
    v1 = os.path.isdir("/sys/fs/cgroup") and \
        not os.path.exists("/sys/fs/cgroup/cgroup.controllers")
    if v1:
        return "CgroupPlugin=cgroup/v1\nCgroupMountpoint=/sys/fs/cgroup\nCgroupAutomount=no\n"
    return "CgroupPlugin=autodetect\n"


def reap_dead_runs(tmpdir: str | None = None) -> list[str]:
    """End the daemons of test Slurms whose owner process is gone; return their dirs.

    Only processes recorded by such a run, with the recorded start time, are
    signalled; runs of live owners are never touched.
    """
    reaped = []
    pattern = os.path.join(tmpdir or tempfile.gettempdir(), "dsrun-slurm-*", "run.json")
    for path in sorted(glob.glob(pattern)):
        try:
            record = json.loads(Path(path).read_text())
            if owner_alive(record):
                continue
            daemons = [(int(d["pid"]), float(d["ctime"])) for d in record["daemons"]]
        except (OSError, ValueError, KeyError, TypeError):
            continue
        live = [p for p in (same_process(pid, ct) for pid, ct in daemons) if p is not None]
        log.warning("ending %d daemon(s) of test Slurm %s left by dead process %s",
                    len(live), os.path.dirname(path), record["owner_pid"])
        kill_procs(live, grace=5.0)
        shutil.rmtree(os.path.dirname(path), ignore_errors=True)
        reaped.append(os.path.dirname(path))
    return reaped


class SlurmCluster:
    """Slurm over an already started SimCluster; see the module docstring."""

    def __init__(self, sim: SimCluster, proctrack: str = "proctrack/linuxproc") -> None:
        """``proctrack``: slurm.conf's ProctrackType (one that needs no cgroup setup)."""
        reap_dead_runs()
        self.sim = sim
        self.proctrack = proctrack
        self.workdir = Path(tempfile.mkdtemp(prefix="dsrun-slurm-"))
        os.chmod(self.workdir, 0o755)  # munged wants its socket directory reachable
        self.conf = self.workdir / "slurm.conf"
        self.procs: list[subprocess.Popen[bytes]] = []
        sim.daemons.add("slurmd")

    @property
    def nodes(self) -> list[str]:
        return [h.name for h in self.sim.hosts]

    def env(self, **extra: str) -> dict[str, str]:
        """An environment for Slurm clients (srun, salloc, sinfo) and dsrun."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
        return {**env, "SLURM_CONF": str(self.conf), **extra}

    def _spawn(self, argv: list[str], log_name: str, env: dict[str, str] | None = None) -> None:
        self.procs.append(subprocess.Popen(
            argv, env=env, stdout=self._log(log_name), stderr=subprocess.STDOUT,
            start_new_session=True))
        self._write_record()

    def _write_record(self) -> None:
        # Lets a later run end these daemons if this process dies without teardown().
        daemons = []
        for proc in self.procs:
            try:
                daemons.append({"pid": proc.pid, "ctime": psutil.Process(proc.pid).create_time()})
            except psutil.NoSuchProcess:
                pass
        record = {**owner_record(), "daemons": daemons}
        tmp = self.workdir / "run.json.tmp"
        tmp.write_text(json.dumps(record))
        tmp.replace(self.workdir / "run.json")

    def _log(self, name: str):  # noqa: ANN202 - a file object
        return open(self.workdir / f"{name}.out", "wb")

    def start(self, timeout: float = 30.0) -> SlurmCluster:
        try:
            self._start_munge()
            self._write_conf()
            env = self.env()
            self._spawn(["slurmctld", "-D", "-i", "-f", str(self.conf)], "slurmctld", env)
            for host in self.sim.hosts:
                (self.workdir / f"spool-{host.name}").mkdir()
                self._spawn(self.sim.nsenter_argv(host, ["slurmd", "-D", "-f", str(self.conf)]),
                            f"slurmd-{host.name}", env)
            self._wait_idle(timeout)
        except BaseException:
            self.teardown()
            raise
        return self

    def _start_munge(self) -> None:
        key = self.workdir / "munge.key"
        key.write_bytes(os.urandom(128))
        key.chmod(0o600)
        self.munge_socket = self.workdir / "munge.sock"
        self._spawn(["munged", "-F", "--force", f"--socket={self.munge_socket}",
                     f"--key-file={key}", f"--pid-file={self.workdir}/munged.pid",
                     f"--log-file={self.workdir}/munged.log",
                     f"--seed-file={self.workdir}/munged.seed"], "munged")
        deadline = time.monotonic() + 10
        while not self.munge_socket.exists():
            if time.monotonic() > deadline or self.procs[-1].poll() is not None:
                raise RuntimeError(f"munged did not start: {self.logs('munged')}")
            time.sleep(0.05)

    def _write_conf(self) -> None:
        w = self.workdir
        nodes = "\n".join(f"NodeName={h.name} NodeAddr={h.address} CPUs={CPUS_PER_NODE} "
                          f"State=UNKNOWN" for h in self.sim.hosts)
        self.conf.write_text(f"""ClusterName=dsrtest
SlurmctldHost={socket.gethostname()}({self.sim.bridge_address})
SlurmctldPort={_free_port()}
SlurmdPort={_free_port()}
AuthType=auth/munge
AuthInfo=socket={self.munge_socket}
CredType=cred/munge
SlurmUser=root
SlurmdUser=root
StateSaveLocation={w}/state
SlurmdSpoolDir={w}/spool-%n
SlurmctldPidFile={w}/slurmctld.pid
SlurmdPidFile={w}/slurmd-%n.pid
SlurmctldLogFile={w}/slurmctld.log
SlurmdLogFile={w}/slurmd-%n.log
SlurmdParameters=config_overrides
ProctrackType={self.proctrack}
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
MpiDefault=none
ReturnToService=2
KillWait=5
{nodes}
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
""")
        (w / "cgroup.conf").write_text(_cgroup_conf())
        (w / "state").mkdir()

    def _wait_idle(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        text = ""
        while time.monotonic() < deadline:
            for proc in self.procs:
                if proc.poll() is not None:
                    raise RuntimeError(f"{proc.args[0]} exited with {proc.returncode}: "
                                       f"{self.logs()}")
            res = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %T"], env=self.env(),
                                 capture_output=True, text=True, timeout=30)
            text = res.stdout + res.stderr
            if sum(line.split()[-1:] == ["idle"] for line in res.stdout.splitlines()) \
                    == len(self.sim.hosts):
                return
            time.sleep(0.3)
        raise RuntimeError(f"Slurm nodes not idle after {timeout}s: {text}\n{self.logs()}")

    def logs(self, only: str | None = None) -> str:
        out = []
        for f in sorted(self.workdir.glob("*.out")):
            if only is None or f.stem == only:
                out.append(f"--- {f.name}\n{f.read_text(errors='replace')[-2000:]}")
        return "\n".join(out)

    def jobs(self) -> list[str]:
        """Jobs Slurm still knows as pending or running."""
        res = subprocess.run(["squeue", "-h", "-o", "%i %T"], env=self.env(),
                             capture_output=True, text=True, timeout=30)
        return [ln for ln in res.stdout.splitlines() if ln.strip()]

    def wait_no_jobs(self, timeout: float) -> list[str]:
        """Wait up to ``timeout`` s until Slurm knows no job; returns the jobs
        still listed then. A job whose tasks have all exited stays COMPLETING
        until every slurmd has reported its cleanup, which takes a moment
        longer on a loaded machine; one still listed after ``timeout`` is a
        job Slurm could not finish (a task it could not kill)."""
        deadline = time.monotonic() + timeout
        while True:
            left = self.jobs()
            if not left or time.monotonic() >= deadline:
                return left
            time.sleep(0.2)

    def teardown(self) -> None:
        live = []
        for proc in reversed(self.procs):
            try:
                live.append(psutil.Process(proc.pid))
            except psutil.NoSuchProcess:
                pass
        kill_procs(live, grace=5.0)
        for proc in self.procs:
            proc.wait()
        self.procs.clear()
        shutil.rmtree(self.workdir, ignore_errors=True)
