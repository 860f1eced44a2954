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

Environment: ``job_env`` holds variables dsrun itself decides (shown in
dry-run output); ``user_env`` holds the user's and forwarded variables
(:mod:`dsrun.launcher.envpolicy`), whose values are never printed.
"""

from __future__ import annotations

import shlex
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from dsrun.errors import DsrunUsageError
from dsrun.launcher.envpolicy import JobEnv
from dsrun.launcher.spec import DEFAULT_CPU_RANKS, LaunchSpec

RUNTIME_BOOTSTRAP = "dsrun.runtime.bootstrap"
#: Variables naming the interface gloo/NCCL use for inter-host traffic.
SOCKET_IFNAME_VARS = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")
PENDING = "<chosen at launch>"


@dataclass(frozen=True)
class RankSlot:
    rank: int
    local_rank: int
    device: int | None


@dataclass(frozen=True)
class NodePlan:
    host: str
    node_rank: int
    ranks: tuple[RankSlot, ...]
    devices: tuple[int, ...]
    local: bool = True
    gpus_known: bool = True  # False only in a draft plan
    env: tuple[tuple[str, str], ...] = ()  # host defaults dsrun chose (socket ifname)

    @property
    def has_gpus(self) -> bool:
        return bool(self.devices)


@dataclass(frozen=True)
class NodeSlots:
    """Input to layout: a host and the slots (device indices) chosen on it.

    ``gpus`` None: not known yet (draft plan of a remote host).
    """

    host: str
    slots: tuple[int, ...]
    gpus: bool | None
    local: bool = True
    env: tuple[tuple[str, str], ...] = ()


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

    @property
    def world_size(self) -> int:
        return sum(len(n.ranks) for n in self.nodes)

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
                              node.gpus is not None, node.env))
    return tuple(plans)


def host_slots(host: str, slots: Sequence[int], local: bool,
               devices: Sequence[int] | None,
               env: Mapping[str, str] | None = None) -> NodeSlots:
    """A hostfile node: GPU ranks on the selected devices when its host has
    GPUs (``devices``: the host's visible devices), else one CPU rank per slot.
    ``devices`` None: not known yet (draft plan)."""
    pairs = tuple(sorted((env or {}).items()))
    if devices is None:
        return NodeSlots(host, tuple(slots), None, local, pairs)
    if not devices:
        return NodeSlots(host, tuple(slots), False, local, pairs)
    missing = [s for s in slots if s >= len(devices)]
    if missing:
        raise DsrunUsageError(
            f"host {host} has {len(devices)} GPU(s) but slot(s) "
            f"{','.join(map(str, missing))} are selected (fix its slots= in the hostfile "
            f"or use --num_gpus/--include)")
    return NodeSlots(host, tuple(devices[s] for s in slots), True, local, pairs)


def socket_env(ifname: str | None, user_keys: Iterable[str]) -> dict[str, str]:
    """GLOO/NCCL_SOCKET_IFNAME for a host, unless unknown or set by the user."""
    if not ifname:
        return {}
    taken = set(user_keys)
    return {k: ifname for k in SOCKET_IFNAME_VARS if k not in taken}


def local_slots(num_gpus: int | None, devices: Sequence[int], cpus: int,
                host: str = "localhost") -> NodeSlots:
    """The single-host case: GPU ranks when the host has GPUs, else CPU ranks."""
    if devices:
        n = len(devices) if num_gpus is None else num_gpus
        if n > len(devices):
            raise DsrunUsageError(
                f"--num_gpus {n} asks for more GPUs than this host has ({len(devices)})"
            )
        return NodeSlots(host, tuple(devices[:n]), gpus=True)
    n = min(DEFAULT_CPU_RANKS, max(cpus, 1)) if num_gpus is None else num_gpus
    return NodeSlots(host, tuple(range(n)), gpus=False)


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


def rank_env(plan: LaunchPlan, node: NodePlan, slot: RankSlot) -> dict[str, str]:
    """Variables dsrun sets for one rank (before host-specific ones)."""
    env = dict(plan.job_env)
    env.update(
        RANK=str(slot.rank),
        LOCAL_RANK=str(slot.local_rank),
        WORLD_SIZE=str(plan.world_size),
        LOCAL_WORLD_SIZE=str(len(node.ranks)),
        NODE_RANK=str(node.node_rank),
        NNODES=str(len(plan.nodes)),
        MASTER_ADDR=plan.master_addr or PENDING,
        MASTER_PORT=PENDING if plan.master_port is None else str(plan.master_port),
        DSRUN_JOB_ID=plan.job_id,
        DSRUN_RESTART_COUNT=str(plan.restart_count),
    )
    if node.has_gpus:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(d) for d in node.devices)
    return env


def host_env(local_world_size: int, cpus: int, inherited: Mapping[str, str]) -> dict[str, str]:
    """Variables that depend on the host a rank runs on; user settings win."""
    env: dict[str, str] = {}
    if "OMP_NUM_THREADS" not in inherited:
        env["OMP_NUM_THREADS"] = str(max(1, cpus // max(local_world_size, 1)))
    if "PYTHONUNBUFFERED" not in inherited:
        env["PYTHONUNBUFFERED"] = "1"
    return env


def describe(plan: LaunchPlan) -> list[str]:
    """Rank map lines: host -> global ranks, local ranks, devices."""
    first = plan.nodes[0].host
    addr = plan.master_addr or f"<address of {first}, found there at launch>"
    port = plan.master_port or f"<free port chosen on {first} at launch>"
    lines = [
        f"world size {plan.world_size} on {len(plan.nodes)} node(s), master {addr}:{port}"
    ]
    for node in plan.nodes:
        ranks = ",".join(str(r.rank) for r in node.ranks)
        local = ",".join(str(r.local_rank) for r in node.ranks)
        devices = ",".join(str(d) for d in node.devices) if node.devices else "cpu"
        if not node.gpus_known:
            devices = "GPUs if the host has them, else cpu: found at launch"
        lines.append(
            f"  {node.host}: ranks [{ranks}]  local ranks [{local}]  devices [{devices}]"
        )
    return lines


def format_command(argv: Sequence[str]) -> str:
    return shlex.join(argv)
