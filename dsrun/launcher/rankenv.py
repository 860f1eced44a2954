"""A rank's environment: one builder, named layers, the same everywhere (pure).

The launcher builds each rank's :class:`RankEnv` once (:func:`rank_env`);
it travels to the node agent in the start payload, the agent turns it into
the process environment with :func:`materialize`, and ``--dry-run`` prints
it with :func:`describe`. So what the dry-run shows is what the agent sets,
whatever the backend. Layers, later ones winning:

1. inherited: the environment the node agent starts in (dsrun's own for a
   local agent, the login environment of an SSH host, what mpirun or srun
   give their processes), less the agent's own bootstrap variables
   (:data:`dsrun.launcher.protocol.AGENT_BOOTSTRAP_VARS`) and what a
   parent job's launcher set for its ranks
   (:data:`dsrun.launcher.envlayers.LAUNCHER_OWNED`: dsrun run in a rank);
2. user: the user's and forwarded variables (envpolicy.JobEnv, one set per
   job); their values are never printed or logged; ``$NAME`` in env-file
   values is expanded against layer 1 with the job's other variables over
   it, on the host (envlayers.py);
3. defaults: set only where layers 1-2 leave the name unset
   (``OMP_NUM_THREADS``: the host's usable CPUs shared among its ranks, or
   under ``--bind_cores_to_rank`` the rank's own CPUs;
   ``PYTHONUNBUFFERED=1``; ``GLOO/NCCL_SOCKET_IFNAME`` on multi-host jobs);
4. PATH prefix: directories put in front of the inherited ``PATH`` (the
   launcher interpreter's, for agents that start in a login environment);
5. dsrun: ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``DSRUN_CPU_AFFINITY``
   (``--bind_cores_to_rank``), ... - always win;
6. agent: the agent's process marker and the rank's error file, which only
   the agent on the host knows.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from dsrun.errors import DsrunUsageError
from dsrun.launcher.cores import AFFINITY_VAR, format_cpu_list
from dsrun.launcher.envlayers import apply_layers
from dsrun.launcher.envpolicy import JobEnv
from dsrun.launcher.plan import PENDING, LaunchPlan, NodePlan, RankSlot

#: Set by the agent on each rank (layer 6); shown as placeholders.
AGENT_VARS = {
    "DSRUN_AGENT_ID": "<set by the agent: marks the job's processes on the host>",
    "DSRUN_AGENT_PID": "<set by the agent: its pid; the rank dies with it>",
    "DSRUN_ERROR_FILE": "<set by the agent: where the rank records an uncaught error>",
    "DSRUN_STACK_FILE": "<set by the agent: where the rank writes its stacks for dsrun stack>",
}

Pairs = tuple[tuple[str, str], ...]

#: torchrun's restart variables, which dsrun sets too (the attempt, from 0,
#: and --max_restarts): a torchrun script reads them to know its attempt.
#: A value the user gives (--env, an env file) is left alone.
TORCHELASTIC_VARS = ("TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS")


def torchelastic_env(job_env: Pairs, restart: int, max_restarts: int) -> Pairs:
    """``job_env`` (LaunchPlan.job_env) with torchrun's restart variables."""
    env = dict(job_env)
    env.update(zip(TORCHELASTIC_VARS, (str(restart), str(max_restarts)), strict=True))
    return tuple(sorted(env.items()))


_SLOTS = "--include/--exclude/--num_nodes/--num_gpus (which slots run)"
#: What to use instead of giving a variable that dsrun sets for each rank.
INSTEAD = {
    "RANK": _SLOTS, "LOCAL_RANK": _SLOTS, "NODE_RANK": _SLOTS, "WORLD_SIZE": _SLOTS,
    "LOCAL_WORLD_SIZE": _SLOTS, "NNODES": _SLOTS, "CROSS_RANK": _SLOTS, "CROSS_SIZE": _SLOTS,
    "LOCAL_SIZE": _SLOTS,
    "MASTER_ADDR": "--master_addr", "MASTER_PORT": "--master_port",
    "CUDA_VISIBLE_DEVICES": "--include HOST:SLOTS, or CUDA_VISIBLE_DEVICES in dsrun's own "
                            "environment (the slots then count those GPUs)",
    AFFINITY_VAR: "--bind_core_list", "DSRUN_ACCELERATOR": "--cpu",
    "DSRUN_DIST_BACKEND": "--dist_backend", "DSRUN_CONFIG": "--config",
    "DSRUN_LOCAL_RANK_FILL": "--no_local_rank",
}


@dataclass(frozen=True)
class RankEnv:
    """Layers 3-5 of one rank (1 is the host's, 2 the job's, 6 the agent's)."""

    dsrun: Pairs
    defaults: Pairs = ()
    path_prepend: tuple[str, ...] = ()

    def to_json(self) -> dict[str, Any]:
        return {"dsrun": dict(self.dsrun), "defaults": dict(self.defaults),
                "path_prepend": list(self.path_prepend)}

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> RankEnv:
        return cls(tuple(sorted(obj.get("dsrun", {}).items())),
                   tuple(sorted(obj.get("defaults", {}).items())),
                   tuple(obj.get("path_prepend", ())))


def omp_threads(cpus: int | None, local_world_size: int) -> str:
    if cpus is None:
        return f"{PENDING}: usable CPUs of the host / {local_world_size}"
    return str(max(1, cpus // max(local_world_size, 1)))


def rank_env(plan: LaunchPlan, node: NodePlan, slot: RankSlot) -> RankEnv:
    """The environment layers dsrun decides for one rank."""
    env = dict(plan.job_env)
    env.update(
        RANK=str(slot.rank),
        LOCAL_RANK=str(slot.local_rank),
        WORLD_SIZE=str(plan.world_size),
        LOCAL_WORLD_SIZE=str(len(node.ranks)),
        NODE_RANK=str(node.node_rank),
        NNODES=str(len(plan.nodes)),
        # DeepSpeed's launcher's names for the same three (its CPU
        # accelerator counts devices by LOCAL_SIZE; its checkpoint writers
        # read CROSS_RANK / CROSS_SIZE)
        CROSS_RANK=str(node.node_rank),
        CROSS_SIZE=str(len(plan.nodes)),
        LOCAL_SIZE=str(len(node.ranks)),
        MASTER_ADDR=plan.master_addr or PENDING,
        MASTER_PORT=PENDING if plan.master_port is None else str(plan.master_port),
        DSRUN_JOB_ID=plan.job_id,
        DSRUN_RESTART_COUNT=str(plan.restart_count),
    )
    for key in TORCHELASTIC_VARS:
        if key in plan.user_env.keys():  # the user's value (TORCHELASTIC_VARS)
            env.pop(key, None)
    if node.has_gpus:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(d) for d in node.devices)
    threads = omp_threads(node.cpus, len(node.ranks))
    if plan.bind_cores:
        if slot.cpus is None:
            env[AFFINITY_VAR] = f"{PENDING}: this rank's share of the host's CPUs"
            threads = f"{PENDING}: the number of CPUs in {AFFINITY_VAR}"
        else:
            env[AFFINITY_VAR] = format_cpu_list(slot.cpus)
            threads = str(len(slot.cpus))
    defaults = {"OMP_NUM_THREADS": threads, "PYTHONUNBUFFERED": "1", **dict(node.env)}
    for key in plan.user_env.keys():
        defaults.pop(key, None)  # the user's value wins wherever the agent runs
    return RankEnv(tuple(sorted(env.items())), tuple(sorted(defaults.items())),
                   node.path_prepend)


def check_user_env(plan: LaunchPlan) -> None:
    """A variable given with ``--env`` or in an env file that dsrun sets for
    each rank (layers 5-6) would be silently replaced: a usage error naming
    what to use instead. Variables forwarded from the launcher's environment
    are left to lose quietly (a parent job's MASTER_ADDR is no mistake)."""
    decided = set(AGENT_VARS)
    for node in plan.nodes:
        for slot in node.ranks[:1]:
            decided.update(key for key, _ in rank_env(plan, node, slot).dsrun)
    for entry in plan.user_env.entries:
        if entry.key not in decided or entry.source == "forwarded" \
                or entry.source.startswith("--env_prefix"):
            continue
        instead = INSTEAD.get(entry.key)
        advice = f"use {instead}" if instead else "it cannot be set"
        raise DsrunUsageError(f"{entry.source} sets {entry.key}, which dsrun sets for each "
                              f"rank: {advice}")


def materialize(env: RankEnv, inherited: Mapping[str, str], user: Mapping[str, str] | JobEnv,
                agent: Mapping[str, str]) -> dict[str, str]:
    """The process environment of a rank: layers 1-6 in order (the agent's
    :func:`dsrun.launcher.envlayers.apply_layers` on this RankEnv; a JobEnv's
    env-file values are expanded against ``inherited``, as the agent does)."""
    if isinstance(user, JobEnv):
        return apply_layers(env.to_json(), inherited, user.as_dict(), agent, user.files)
    return apply_layers(env.to_json(), inherited, user, agent)


def describe(env: RankEnv, user: JobEnv, base: str,
             inherited: Mapping[str, str] | None = None) -> list[str]:
    """Dry-run lines for one rank. ``base`` names layer 1; ``inherited`` is
    its content when the launcher knows it (an agent on this host)."""
    lines = [f"{k}={v}" for k, v in env.dsrun]
    for key, value in env.defaults:
        if inherited is None:
            lines.append(f"{key}={value} (unless set in {base})")
        elif key not in inherited:
            lines.append(f"{key}={value}")
    ours = dict(env.dsrun)  # a user value of these is replaced: do not list it
    lines.extend(JobEnv(tuple(e for e in user.entries if e.key not in ours)).describe())
    if env.path_prepend:
        lines.append(f"PATH=<{os.pathsep.join(env.path_prepend)} in front of the PATH of "
                     f"{base}>")
    lines.extend(f"{k}={v}" for k, v in AGENT_VARS.items())
    lines.append(f"(plus {base})")
    return lines


def env_lines(lines: Sequence[str]) -> list[str]:
    """The variable lines of :func:`describe`'s output (for comparisons)."""
    return [ln for ln in lines if "=" in ln and not ln.startswith("(")]
