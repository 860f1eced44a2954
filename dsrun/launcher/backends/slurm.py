"""Slurm backend: one ``srun`` starts every rank's agent (``--launcher slurm``).

Inside an allocation (``SLURM_JOB_ID`` set: salloc, sbatch) srun starts a
job step; outside one, ``--slurm_args`` (e.g. ``"--partition=gpu
--time=1:00:00"``) are required and srun gets the allocation itself. The
plan becomes one srun argv (:func:`srun_argv`, pure and golden-tested):
``--nodes``, ``--ntasks``, and

- hosts known by name (a hostfile, or the allocation's node list):
  ``--distribution=arbitrary --nodelist=`` one host per task in rank order,
  so each rank runs exactly where the plan says, also with uneven slots;
- hosts not known yet (outside an allocation, no hostfile): ``--ntasks-per-
  node``; the hosts are named by the agents when they connect back;

then ``--kill-on-bad-exit=1``, ``--export=ALL,NAMES`` (srun passes its
whole environment; without ``ALL`` the tasks would get only the named
variables and no PATH or HOME; the names list what dsrun relies on),
``--chdir``, ``--slurm_args`` and the agent. The agents connect back as
under mpirun (connect.py); each starts its rank, which inherits the
``SLURM_*`` variables (MPI with ``--mpi=pmix`` in --slurm_args works).

Without a hostfile the hosts are the allocation's (``SLURM_JOB_NODELIST``),
each with as many slots as it has GPUs (``SLURM_GPUS_ON_NODE``) or else
allocated CPUs (``SLURM_JOB_CPUS_PER_NODE``); by default each host runs
``SLURM_NTASKS_PER_NODE`` ranks when set, else all its GPUs, else 2 CPU ranks.
"""

from __future__ import annotations

import os
import re
import shutil
import sys
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from dsrun.errors import DsrunUsageError, SelectionError
from dsrun.hostlist import expand_counts, expand_hostlist
from dsrun.launcher import netinfo
from dsrun.launcher.backends.base import (
    AgentRequest,
    Backend,
    ConnectSink,
    HostPool,
    JobHandle,
    OutputSink,
    Request,
    agent_payload,
    ignore_connect,
)
from dsrun.launcher.backends.connect import open_connected, tool_environment
from dsrun.launcher.backends.openmpi import controlled_problem, env_names
from dsrun.launcher.hostfile import HostEntry, Hostfile
from dsrun.launcher.plan import LaunchPlan
from dsrun.launcher.spec import DEFAULT_CPU_RANKS, HostsSpec

if TYPE_CHECKING:
    from dsrun.launcher.cluster import Cluster

#: srun options that decide where ranks run or what they inherit: dsrun sets them.
CONTROLLED = ("-N", "--nodes", "-n", "--ntasks", "--ntasks-per-node", "-w", "--nodelist",
              "-m", "--distribution", "--export", "-D", "--chdir", "-F", "--nodefile")
PLACEHOLDER = "slurm-node-{}"
#: Seconds srun gets to exit once every agent's link has ended (an agent
#: dsrun lost included: srun cannot exit while it hangs), then after its
#: SIGTERM, which makes srun kill every task of its step, before SIGKILL.
ENDED_WAIT = (3.0, 10.0)
_GPUS = re.compile(r"(?:.*:)?(\d+)\Z")


def srun_argv(plan: LaunchPlan, agent_argv: Sequence[str], *, named: bool,
              slurm_args: Sequence[str] = (), srun: str = "srun") -> tuple[str, ...]:
    """The one srun command of a plan (pure); ``named``: the plan's hosts
    are Slurm node names (else placeholders the agents will name)."""
    argv = [srun, f"--nodes={len(plan.nodes)}", f"--ntasks={plan.world_size}"]
    if named:
        per_task = ",".join(n.host for n in plan.nodes for _ in n.ranks)
        argv += ["--distribution=arbitrary", f"--nodelist={per_task}"]
    else:
        counts = {len(n.ranks) for n in plan.nodes}
        assert len(counts) == 1, "hosts without names get the same number of ranks"
        argv.append(f"--ntasks-per-node={counts.pop()}")
    argv += ["--kill-on-bad-exit=1", f"--export={','.join(['ALL', *env_names(plan)])}",
             f"--chdir={plan.cwd}", *slurm_args, *agent_argv, "--connect"]
    return tuple(argv)


def allocation_pool(env: Mapping[str, str], num_gpus: int | None,
                    cpu: bool = False) -> HostPool:
    """The hosts of the allocation this launcher runs in (pure); ``cpu``:
    CPU ranks even where the allocation has GPUs (--cpu)."""
    job = env.get("SLURM_JOB_ID", "?")
    try:
        nodes = expand_hostlist(env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
                                or "")
        cpus = expand_counts(env.get("SLURM_JOB_CPUS_PER_NODE") or "1")
    except ValueError as exc:
        raise DsrunUsageError(f"Slurm allocation {job}: {exc}") from None
    if not nodes:
        raise DsrunUsageError(f"Slurm allocation {job}: SLURM_JOB_NODELIST is not set")
    if len(cpus) < len(nodes):
        cpus += [cpus[-1]] * (len(nodes) - len(cpus))
    gpu_text = env.get("SLURM_GPUS_ON_NODE") or env.get("SLURM_GPUS_PER_NODE") or ""
    match = _GPUS.match(gpu_text.strip())
    gpus = int(match.group(1)) if match and not cpu else 0
    slots = [gpus or c for c in cpus[:len(nodes)]]
    default = None
    if num_gpus is None:
        per_node = env.get("SLURM_NTASKS_PER_NODE")
        default = int(per_node) if per_node and per_node.isdigit() else \
            (None if gpus else min(DEFAULT_CPU_RANKS, *slots))
    entries = tuple(HostEntry(h, s, i + 1) for i, (h, s) in enumerate(zip(nodes, slots)))
    return HostPool(Hostfile(f"<Slurm allocation {job}>", entries), True, default)


def placeholder_pool(hs: HostsSpec) -> HostPool:
    """Hosts srun will choose (outside an allocation): named by the agents."""
    if hs.include is not None or hs.exclude is not None:
        raise SelectionError("--include/--exclude with --launcher slurm outside an "
                             "allocation need a hostfile naming the Slurm nodes (-H)")
    count = hs.num_nodes or 1
    slots = hs.num_gpus or DEFAULT_CPU_RANKS
    entries = tuple(HostEntry(PLACEHOLDER.format(i + 1), slots, i + 1) for i in range(count))
    return HostPool(Hostfile("<nodes srun allocates>", entries), False)


class SlurmBackend(Backend):
    name = "slurm"
    agent_per_rank = True
    login_env = False  # srun passes the launcher's whole environment on

    def __init__(self, hosts: HostsSpec | None = None, python: str = sys.executable,
                 environ: Mapping[str, str] | None = None) -> None:
        super().__init__(hosts, python)
        self.environ = dict(os.environ if environ is None else environ)
        self.srun = "srun"
        self.named = True

    @property
    def in_allocation(self) -> bool:
        return bool(self.environ.get("SLURM_JOB_ID"))

    def _need_allocation(self) -> None:
        if not self.in_allocation and not self.hosts.slurm_args:
            raise DsrunUsageError(
                "--launcher slurm outside an allocation (SLURM_JOB_ID is not set): run dsrun "
                "inside salloc/sbatch, or pass --slurm_args with the srun options that get "
                "one (e.g. --slurm_args \"--partition=debug --time=10\")")

    def pool_without_hostfile(self) -> HostPool | None:
        self._need_allocation()
        if self.in_allocation:
            return allocation_pool(self.environ, self.hosts.num_gpus, self.hosts.cpu)
        return placeholder_pool(self.hosts)

    def check(self, cluster: Cluster) -> None:
        self._need_allocation()
        problem = controlled_problem(self.hosts.slurm_args, CONTROLLED, "--slurm_args",
                                     "choose hosts and ranks with -H/--include/--exclude/"
                                     "--num_nodes/--num_gpus", attached_short=True)
        if problem:
            raise DsrunUsageError(problem)
        path = shutil.which(self.srun, path=self.environ.get("PATH"))
        if path is None:
            raise DsrunUsageError("--launcher slurm: srun is not on PATH; run dsrun on a "
                                  "host of the Slurm cluster (Debian: apt-get install "
                                  "slurm-client)")
        self.srun = path
        self.named = cluster.named

    def argv(self, plan: LaunchPlan) -> tuple[str, ...]:
        return srun_argv(plan, self.agent_argv(), named=self.named,
                         slurm_args=self.hosts.slurm_args, srun=self.srun)

    def prepare(self, plan: LaunchPlan) -> Request:
        agents = []
        for node in plan.nodes:
            for slot in node.ranks:
                agents.append(AgentRequest(
                    node.host, agent_payload(plan, node, [slot]),
                    f"started by srun, one agent per rank: {self.python} -m "
                    f"dsrun.launcher.agent --connect",
                    "the environment srun gives its tasks (dsrun's, --export=ALL)",
                    self.environ))
        return Request(self.name, plan, tuple(agents), self.argv(plan), env_names(plan))

    def open(self, plan: LaunchPlan, sink: OutputSink,
             on_connect: ConnectSink = ignore_connect) -> JobHandle:
        prefer = [netinfo.route_source(n.host) for n in plan.nodes
                  if self.named and not n.local]
        # Outside an allocation srun may wait in the queue: no deadline then.
        timeout = max(120.0, 6 * self.hosts.ssh.timeout) if self.in_allocation else None
        return open_connected(plan, "srun", self.argv(plan),
                              tool_environment(plan, self.environ), sink,
                              [p for p in prefer if p], timeout,
                              agent_timeout=max(30.0, 3 * self.hosts.ssh.timeout),
                              on_connect=on_connect, ended_wait=ENDED_WAIT,
                              options="--slurm_args" if self.hosts.slurm_args else None)
