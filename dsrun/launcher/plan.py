"""Rank layout and per-rank environment: pure functions over data.

A LaunchPlan says, for every node, which global/local ranks run there and
on which devices, where the rendezvous is, and what command and environment
each rank gets. It is computed once per attempt and never mutated; backends
and the dry-run printer only read it.

Invariants: global ranks are 0..world_size-1, contiguous per node in node
order; local ranks are 0..n-1 on each node; a node either has a device per
rank (GPU node) or none (CPU node).

A *draft* plan (``--dry-run`` of a job on remote hosts, which connects to
nothing) may leave three things open that only the hosts know: whether a
host has GPUs (``gpus_known``), the master address and the master port
(None). Such values print as placeholders; a plan handed to a backend's
``launch`` is always final (:attr:`LaunchPlan.final`).

:func:`build_plan` is the one plan builder of every launch (any backend,
one host or many, dry-run or real): over the selected hosts of a
:class:`~dsrun.launcher.cluster.Cluster`, with each host's probed facts
(devices, CPUs, the interface to the master) where known.

Environment: ``job_env`` holds variables dsrun itself decides (shown in
dry-run output); ``user_env`` holds the user's and forwarded variables
(:mod:`dsrun.launcher.envpolicy`), whose values are never printed; the
per-rank environment is built from the plan by :mod:`dsrun.launcher.rankenv`.
"""

from __future__ import annotations

import os
import shlex
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from dsrun.errors import DsrunUsageError
from dsrun.launcher.cores import format_cpu_list, parse_cpu_list, rank_cpus
from dsrun.launcher.devices import DeviceId
from dsrun.launcher.envpolicy import JobEnv
from dsrun.launcher.netinfo import host_port
from dsrun.launcher.spec import LaunchSpec

if TYPE_CHECKING:
    from dsrun.launcher.cluster import Cluster

RUNTIME_BOOTSTRAP = "dsrun.runtime.bootstrap"
#: Variables naming the interface gloo/NCCL use for inter-host traffic.
SOCKET_IFNAME_VARS = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")
PENDING = "<chosen at launch>"


@dataclass(frozen=True)
class RankSlot:
    rank: int
    local_rank: int
    device: DeviceId | None  # as CUDA_VISIBLE_DEVICES names it (index or UUID)
    # --bind_cores_to_rank: this rank's CPUs; None: not bound, or not known
    # yet (a draft plan of a remote host; LaunchPlan.bind_cores says which)
    cpus: tuple[int, ...] | None = None


@dataclass(frozen=True)
class NodePlan:
    host: str
    node_rank: int
    ranks: tuple[RankSlot, ...]
    devices: tuple[DeviceId, ...]
    local: bool = True
    gpus_known: bool = True  # False only in a draft plan
    env: tuple[tuple[str, str], ...] = ()  # host defaults dsrun chose (socket ifname)
    cpus: int | None = None  # usable CPUs of the host; None: not known yet (draft)
    path_prepend: tuple[str, ...] = ()  # in front of the PATH the agent starts with
    cpu_list: tuple[int, ...] | None = None  # which CPUs those are; None: not known
    #: The hostfile slot indices selected, while it is not known whether they
    #: are GPUs (draft plan of a remote host; --dry-run shows them).
    slot_indices: tuple[DeviceId, ...] = ()
    hostname: str | None = None  # the host's own name, as its probe said

    @property
    def label(self) -> str:
        """The hostfile entry, and the host's own name where that differs
        (an address: output lines are prefixed with the name)."""
        if not self.hostname or self.hostname == self.host \
                or self.host.startswith(f"{self.hostname}."):
            return self.host
        return f"{self.host} ({self.hostname})"

    @property
    def has_gpus(self) -> bool:
        return bool(self.devices)


@dataclass(frozen=True)
class NodeSlots:
    """Input to layout: a host and the slots (device indices) chosen on it.

    ``gpus`` None: not known yet (draft plan of a remote host).
    """

    host: str
    slots: tuple[DeviceId, ...]  # the devices on a GPU host, else slot indices
    gpus: bool | None
    local: bool = True
    env: tuple[tuple[str, str], ...] = ()
    cpus: int | None = None
    path_prepend: tuple[str, ...] = ()
    cpu_list: tuple[int, ...] | None = None
    hostname: str | None = None


@dataclass(frozen=True)
class NodeFacts:
    """What the plan needs to know of a host: found by its probe, or by the
    launcher itself for this host."""

    devices: tuple[DeviceId, ...]
    cpus: int
    ifname: str | None = None
    cpu_list: tuple[int, ...] | None = None  # the usable CPUs (None: an older agent)
    hostname: str | None = None  # the host's own name (None: not probed)

    @classmethod
    def from_probe(cls, facts: Mapping[str, Any]) -> NodeFacts:
        cpu_list = facts.get("cpu_list")
        return cls(tuple(facts.get("devices") or ()), int(facts.get("cpus") or 1),
                   facts.get("ifname") or None,
                   tuple(int(c) for c in cpu_list) if cpu_list else None,
                   facts.get("host") or None)


@dataclass(frozen=True)
class LaunchPlan:
    job_id: str
    nodes: tuple[NodePlan, ...]
    master_addr: str | None  # None only in a draft plan
    master_port: int | None  # None only in a draft plan
    command: tuple[str, ...]
    job_env: tuple[tuple[str, str], ...] = ()
    user_env: JobEnv = JobEnv()
    cwd: str = "."
    kill_grace: float = 5.0
    log_dir: str | None = None
    restart_count: int = 0
    # DeepSpeed-launcher compatibility: "--local_rank" or "--local-rank",
    # inserted as FLAG=N right after the script, before its arguments
    # (at index ``args_at`` of ``command``); None: environment only.
    local_rank_arg: str | None = None
    args_at: int = 0
    # --bind_cores_to_rank: each rank's RankSlot.cpus; --bind_core_list: the
    # CPUs to share out (None: all the host may use)
    bind_cores: bool = False
    bind_core_list: tuple[int, ...] | None = None

    @property
    def world_size(self) -> int:
        return sum(len(n.ranks) for n in self.nodes)

    @property
    def injected(self) -> bool:
        """Whether ranks run the injected runtime (not ``--no_python``)."""
        return RUNTIME_BOOTSTRAP in self.command[:3]

    @property
    def final(self) -> bool:
        return (self.master_addr is not None and self.master_port is not None
                and all(n.gpus_known for n in self.nodes))


def layout(nodes: Sequence[NodeSlots]) -> tuple[NodePlan, ...]:
    """Assign global ranks node by node, local ranks in slot order."""
    plans = []
    next_rank = 0
    for node_rank, node in enumerate(nodes):
        if not node.slots:
            raise DsrunUsageError(f"host {node.host} has no slots selected")
        ranks = tuple(
            RankSlot(next_rank + i, i, slot if node.gpus else None)
            for i, slot in enumerate(node.slots)
        )
        next_rank += len(ranks)
        devices = tuple(node.slots) if node.gpus else ()
        plans.append(NodePlan(node.host, node_rank, ranks, devices, node.local,
                              node.gpus is not None, node.env, node.cpus, node.path_prepend,
                              node.cpu_list, tuple(node.slots) if node.gpus is None else (),
                              node.hostname))
    return tuple(plans)


def host_slots(host: str, slots: Sequence[int], local: bool,
               devices: Sequence[DeviceId] | None,
               env: Mapping[str, str] | None = None, cpus: int | None = None,
               path_prepend: Sequence[str] = (),
               cpu_list: Sequence[int] | None = None,
               hostname: str | None = None) -> NodeSlots:
    """A hostfile node: GPU ranks on the selected devices when its host has
    GPUs (``devices``: the host's visible devices), else one CPU rank per slot.
    ``devices`` None: not known yet (draft plan)."""
    pairs = tuple(sorted((env or {}).items()))
    extra = {"cpus": cpus, "path_prepend": tuple(path_prepend),
             "cpu_list": tuple(cpu_list) if cpu_list is not None else None,
             "hostname": hostname}
    if devices is None:
        return NodeSlots(host, tuple(slots), None, local, pairs, **extra)
    if not devices:
        return NodeSlots(host, tuple(slots), False, local, pairs, **extra)
    missing = [s for s in slots if s >= len(devices)]
    if missing:
        raise DsrunUsageError(
            f"host {host} has {len(devices)} GPU(s) but slot(s) "
            f"{','.join(map(str, missing))} are selected (fix its slots= in the hostfile "
            f"or use --num_gpus/--include)")
    return NodeSlots(host, tuple(devices[s] for s in slots), True, local, pairs, **extra)


def socket_env(ifname: str | None, user_keys: Iterable[str]) -> dict[str, str]:
    """GLOO/NCCL_SOCKET_IFNAME for a host, unless unknown or set by the user."""
    if not ifname:
        return {}
    taken = set(user_keys)
    return {k: ifname for k in SOCKET_IFNAME_VARS if k not in taken}


def rank_command(spec: LaunchSpec, python: str) -> tuple[str, ...]:
    """The argv every rank runs; the bootstrap injects the runtime first."""
    if spec.no_python:
        return (spec.script, *spec.script_args)
    mode = "--module" if spec.module else "--script"
    return (python, "-m", RUNTIME_BOOTSTRAP, mode, spec.script, *spec.script_args)


def command_fields(spec: LaunchSpec, python: str) -> dict[str, Any]:
    """LaunchPlan fields that describe the rank command."""
    command = rank_command(spec, python)
    return {"command": command, "local_rank_arg": spec.local_rank_arg,
            "args_at": len(command) - len(spec.script_args)}


def rank_argv(plan: LaunchPlan, slot: RankSlot) -> list[str]:
    """The exact argv of one rank."""
    argv = list(plan.command)
    if plan.local_rank_arg:
        argv.insert(plan.args_at, f"{plan.local_rank_arg}={slot.local_rank}")
    return argv


def job_env_of(spec: LaunchSpec) -> tuple[tuple[str, str], ...]:
    """Job-wide variables dsrun sets from the spec (printed by --dry-run)."""
    env = {}
    if spec.cpu:
        # The ranks see no GPU, so the runtime, torch and the script itself
        # all take the CPU path; DSRUN_ACCELERATOR says why.
        env["DSRUN_ACCELERATOR"] = "cpu"
        env["CUDA_VISIBLE_DEVICES"] = ""
    if spec.dist_backend is not None:
        env["DSRUN_DIST_BACKEND"] = spec.dist_backend
    if spec.config is not None:
        env["DSRUN_CONFIG"] = os.path.abspath(spec.config)
    if spec.no_local_rank:
        env["DSRUN_LOCAL_RANK_FILL"] = "0"  # the runtime leaves --local_rank alone
    return tuple(sorted(env.items()))


def build_plan(spec: LaunchSpec, cluster: Cluster, env: JobEnv, job_id: str, *,
               facts: Sequence[NodeFacts | None], python: str, cwd: str,
               master: tuple[str, int] | None = None, restart_count: int = 0,
               remote_path: Sequence[str] = ()) -> LaunchPlan:
    """The plan of one attempt over ``cluster`` (pure): the one plan builder.

    ``facts[i]``: what is known of host i (None: nothing yet, a draft).
    ``master``: the rendezvous the probe settled (None: a draft, whose
    address is --master_addr, or 127.0.0.1 for a job on this host alone,
    and whose port is --master_port).
    ``remote_path``: put in front of PATH on hosts that are not this one
    (backends whose agents start in a login environment). With ``--cpu``
    every host counts as GPU-less.
    """
    multi = len(cluster.hosts) > 1
    nodes = []
    for i, host in enumerate(cluster.hosts):
        known = facts[i]
        ifname = known.ifname if known is not None and multi else None
        devices = () if spec.cpu else known.devices if known is not None else None
        nodes.append(host_slots(
            host, cluster.slots[i], cluster.local[i], devices,
            socket_env(ifname, env.keys()), known.cpus if known is not None else None,
            () if cluster.local[i] else remote_path,
            known.cpu_list if known is not None else None,
            known.hostname if known is not None else None))
    if master is not None:
        addr, port = master
    else:
        single = not multi and cluster.local[0]
        # an explicit --master_port is the port the ranks get (a draft shows it)
        addr = spec.master_addr or ("127.0.0.1" if single else None)
        port = spec.master_port
    core_list = parse_cpu_list(spec.bind_core_list) if spec.bind_core_list else None
    laid_out = layout(nodes)
    if spec.bind_cores_to_rank:
        unsaid = [h for h, known in zip(cluster.hosts, facts)
                  if known is not None and known.cpu_list is None]
        if unsaid:
            raise DsrunUsageError(f"--bind_cores_to_rank: the dsrun agent on "
                                  f"{', '.join(unsaid)} did not say which CPUs it may use (an "
                                  f"older dsrun there?); install the same dsrun on every host")
        laid_out = tuple(bind_node(node, core_list) for node in laid_out)
    return LaunchPlan(
        job_id=job_id,
        nodes=laid_out,
        master_addr=addr,
        master_port=port,
        **command_fields(spec, python),
        job_env=job_env_of(spec),
        user_env=env,
        cwd=cwd,
        kill_grace=spec.kill_grace,
        log_dir=os.path.abspath(spec.log_dir) if spec.log_dir else None,
        restart_count=restart_count,
        bind_cores=spec.bind_cores_to_rank,
        bind_core_list=core_list,
    )


def bind_node(node: NodePlan, core_list: Sequence[int] | None) -> NodePlan:
    """``node`` with each rank's CPUs (:mod:`dsrun.launcher.cores`), where the
    host's usable CPUs are known."""
    if node.cpu_list is None:
        return node
    shares = rank_cpus(node.host, node.cpu_list, core_list, len(node.ranks))
    return replace(node, ranks=tuple(replace(slot, cpus=cpus)
                                     for slot, cpus in zip(node.ranks, shares)))


def describe(plan: LaunchPlan) -> list[str]:
    """Rank map lines: host -> global ranks, local ranks, devices."""
    first = plan.nodes[0].host
    addr = plan.master_addr or f"<address of {first}, found there at launch>"
    port = plan.master_port or f"<free port chosen on {first} at launch>"
    master = host_port(addr, port) if plan.master_addr else f"{addr}:{port}"
    lines = [
        f"world size {plan.world_size} on {len(plan.nodes)} node(s), master {master}"
    ]
    for node in plan.nodes:
        ranks = ",".join(str(r.rank) for r in node.ranks)
        local = ",".join(str(r.local_rank) for r in node.ranks)
        devices = ",".join(str(d) for d in node.devices) if node.devices else "cpu"
        if not node.gpus_known:
            slots = ",".join(str(s) for s in node.slot_indices)
            devices = (f"GPUs {slots} if the host has them, else cpu: found at launch"
                       if slots else "GPUs if the host has them, else cpu: found at launch")
        lines.append(
            f"  {node.label}: ranks [{ranks}]  local ranks [{local}]  devices [{devices}]"
        )
        if plan.bind_cores:
            pool = "--bind_core_list" if plan.bind_core_list else "the CPUs the host may use"
            shares = [r.cpus for r in node.ranks]
            lines.append("    CPUs per rank: " + (
                f"equal shares of {pool}, found at launch" if None in shares
                else "  ".join(f"[{format_cpu_list(c or ())}]" for c in shares)))
    return lines


def format_command(argv: Sequence[str]) -> str:
    return shlex.join(argv)
