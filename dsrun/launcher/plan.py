"""Rank layout and per-rank environment: pure functions over data.

A LaunchPlan says, for every node, which global/local ranks run there and
on which devices, where the rendezvous is, and what command and environment
each rank gets. It is computed once per attempt and never mutated; backends
and the dry-run printer only read it.

Invariants: global ranks are 0..world_size-1, contiguous per node in node
order; local ranks are 0..n-1 on each node; a node either has a device per
rank (GPU node) or none (CPU node).
"""

from __future__ import annotations

import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from dsrun.errors import DsrunUsageError
from dsrun.launcher.spec import DEFAULT_CPU_RANKS, LaunchSpec

RUNTIME_BOOTSTRAP = "dsrun.runtime.bootstrap"


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

    @property
    def has_gpus(self) -> bool:
        return bool(self.devices)


@dataclass(frozen=True)
class NodeSlots:
    """Input to layout: a host and the slots (device indices) chosen on it."""

    host: str
    slots: tuple[int, ...]
    gpus: bool
    local: bool = True


@dataclass(frozen=True)
class LaunchPlan:
    job_id: str
    nodes: tuple[NodePlan, ...]
    master_addr: str
    master_port: int
    command: tuple[str, ...]
    job_env: tuple[tuple[str, str], ...] = ()
    cwd: str = "."
    kill_grace: float = 5.0
    log_dir: str | None = None
    restart_count: int = 0

    @property
    def world_size(self) -> int:
        return sum(len(n.ranks) for n in self.nodes)


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
        plans.append(NodePlan(node.host, node_rank, ranks, devices, node.local))
    return tuple(plans)


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
        MASTER_ADDR=plan.master_addr,
        MASTER_PORT=str(plan.master_port),
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
    lines = [
        f"world size {plan.world_size} on {len(plan.nodes)} node(s), "
        f"master {plan.master_addr}:{plan.master_port}"
    ]
    for node in plan.nodes:
        ranks = ",".join(str(r.rank) for r in node.ranks)
        local = ",".join(str(r.local_rank) for r in node.ranks)
        devices = ",".join(str(d) for d in node.devices) if node.devices else "cpu"
        lines.append(
            f"  {node.host}: ranks [{ranks}]  local ranks [{local}]  devices [{devices}]"
        )
    return lines


def format_command(argv: Sequence[str]) -> str:
    return shlex.join(argv)
