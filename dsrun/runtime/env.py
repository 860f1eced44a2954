"""DistEnv: where this rank sits in the job, read once from the environment.

Sources, first match wins:

1. dsrun's (and torchrun's) ``RANK``/``WORLD_SIZE``/``LOCAL_RANK``/...;
2. MPI launchers: Open MPI (``OMPI_COMM_WORLD_*``), MVAPICH
   (``MV2_COMM_WORLD_*``), PMI (MPICH, Intel MPI: ``PMI_RANK``/``PMI_SIZE``,
   ``MPI_LOCALRANKID``/``MPI_LOCALNRANKS``);
3. Slurm's ``srun``: ``SLURM_PROCID``, ``SLURM_NTASKS``, ``SLURM_LOCALID``,
   the tasks on this node from ``SLURM_STEP_TASKS_PER_NODE`` and
   ``SLURM_NODEID``, the nodes from ``SLURM_STEP_NODELIST``;
4. PMIx alone (``PMIX_RANK``): the world size comes from MPI;
5. else a single process.

``rendezvous`` says how the master address and port are found when
``MASTER_ADDR``/``MASTER_PORT`` are not both set (dist.py does it): ``mpi``
(rank 0 opens the store on a free port and broadcasts its address with
mpi4py), ``slurm`` (the first node of the step, and a port derived from the
job and step ids), or ``env`` (they must be set; world size 1 needs none).

The object is frozen. The runtime writes os.environ in one place only:
``dsrun.init_distributed`` exports the rank variables it placed from MPI
or Slurm (:func:`dsrun.runtime.dist.discovered_variables`), as DeepSpeed's does.

``accelerator`` is ``DSRUN_ACCELERATOR``: ``"cpu"`` when the launcher was
asked for CPU ranks (``dsrun --cpu``), which then use gloo even where CUDA
is present. DeepSpeed's ``DS_ACCELERATOR=cpu`` means the same (DeepSpeed
then trains on the CPU with a CPU backend); other values of it are left to
:mod:`dsrun.accelerator`.
``config_path`` is ``DSRUN_CONFIG``: the training config (DeepSpeed JSON)
the launcher hands every rank (``dsrun --config``).
``agent_pid`` (``DSRUN_AGENT_PID``) and ``stack_file`` (``DSRUN_STACK_FILE``)
come from the rank's node agent: the rank dies with that process
(deathsig.py) and writes its stacks to that file on request (stackdump.py).
``fill_local_rank`` is False when the launcher was given ``--no_local_rank``
(``DSRUN_LOCAL_RANK_FILL=0``): the runtime then leaves ``--local_rank`` to
the script (localrank.py).
``cuda_visible_devices`` is ``CUDA_VISIBLE_DEVICES`` as the rank got it; dist.py
names it when the local rank has no GPU of its own.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from dsrun.errors import DsrunError
from dsrun.hostlist import expand_counts, expand_hostlist

#: Base of the port a job started by ``srun`` uses when MASTER_PORT is unset.
SLURM_PORT_BASE = 20000
SLURM_PORT_SPAN = 20000


@dataclass(frozen=True)
class Source:
    """Environment variables one kind of launcher sets for its processes."""

    name: str
    rank: str
    size: str
    local_rank: str
    local_size: str
    rendezvous: str


#: In order of precedence; Slurm and PMIx are handled by their own functions.
SOURCES = (
    Source("dsrun/torchrun", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "env"),
    Source("Open MPI", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
           "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE", "mpi"),
    Source("MVAPICH", "MV2_COMM_WORLD_RANK", "MV2_COMM_WORLD_SIZE",
           "MV2_COMM_WORLD_LOCAL_RANK", "MV2_COMM_WORLD_LOCAL_SIZE", "mpi"),
    Source("PMI", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS", "mpi"),
)


@dataclass(frozen=True)
class DistEnv:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    master_addr: str | None = None
    master_port: int | None = None
    source: str = "single process"
    rendezvous: str = "env"  # how to find the master when not given: env | mpi | slurm
    backend: str | None = None  # DSRUN_DIST_BACKEND, if the launcher set one
    job_id: str | None = None
    restart_count: int = 0
    error_file: str | None = None
    config_path: str | None = None  # DSRUN_CONFIG, a launcher-given training config
    accelerator: str | None = None  # DSRUN_ACCELERATOR: "cpu" under dsrun --cpu
    nodes: tuple[str, ...] = ()  # the job's hosts, where the launcher says (Slurm)
    slurm_job: tuple[int, int] | None = None  # (job id, step id) under srun
    agent_pid: int | None = None  # DSRUN_AGENT_PID: the node agent that started the rank
    stack_file: str | None = None  # DSRUN_STACK_FILE: where stacks go on request
    fill_local_rank: bool = True  # DSRUN_LOCAL_RANK_FILL != "0"
    cuda_visible_devices: str | None = None  # CUDA_VISIBLE_DEVICES, for error messages

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world_size:
            raise DsrunError(f"rank {self.rank} outside world size {self.world_size} "
                             f"(from {self.source} environment)")
        if not 0 <= self.local_rank < max(self.local_world_size, 1):
            raise DsrunError(f"local rank {self.local_rank} outside local world size "
                             f"{self.local_world_size} (from {self.source} environment)")

    @property
    def master_known(self) -> bool:
        return self.master_addr is not None and self.master_port is not None

    @classmethod
    def detect(cls, environ: Mapping[str, str] | None = None,
               mpi_size: Callable[[], int] | None = None) -> DistEnv:
        """Read the environment. ``mpi_size`` gives the MPI world size when
        only PMIx's rank is set (dist.py passes mpi4py's; None: an error)."""
        env = os.environ if environ is None else environ
        common = dict(
            master_addr=env.get("MASTER_ADDR") or None,
            master_port=_int(env, "MASTER_PORT", None),
            backend=env.get("DSRUN_DIST_BACKEND") or None,
            job_id=env.get("DSRUN_JOB_ID") or None,
            restart_count=_int(env, "DSRUN_RESTART_COUNT", 0) or 0,
            error_file=env.get("DSRUN_ERROR_FILE") or None,
            config_path=env.get("DSRUN_CONFIG") or None,
            accelerator=env.get("DSRUN_ACCELERATOR") or (
                "cpu" if env.get("DS_ACCELERATOR", "").strip().lower() == "cpu" else None),
            agent_pid=_int(env, "DSRUN_AGENT_PID", None),
            stack_file=env.get("DSRUN_STACK_FILE") or None,
            fill_local_rank=env.get("DSRUN_LOCAL_RANK_FILL", "1") != "0",
            cuda_visible_devices=env.get("CUDA_VISIBLE_DEVICES"),
        )
        for src in SOURCES:
            if src.rank in env and src.size in env:
                world = _int(env, src.size, 1) or 1
                return cls(rank=_int(env, src.rank, 0) or 0, world_size=world,
                           local_rank=_int(env, src.local_rank, 0) or 0,
                           local_world_size=_int(env, src.local_size, world) or world,
                           source=src.name, rendezvous=src.rendezvous, **common)
        if "SLURM_PROCID" in env and ("SLURM_STEP_NUM_TASKS" in env or "SLURM_NTASKS" in env):
            return cls(**slurm_fields(env), **common)
        if "PMIX_RANK" in env:
            if mpi_size is None:
                raise DsrunError("PMIX_RANK is set but not the world size: it comes from "
                                 "MPI (install mpi4py)")
            return cls(rank=_int(env, "PMIX_RANK", 0) or 0, world_size=mpi_size(),
                       local_rank=_int(env, "PMIX_LOCAL_RANK", 0) or 0,
                       local_world_size=_int(env, "PMIX_LOCAL_SIZE", 1) or 1,
                       source="PMIx", rendezvous="mpi", **common)
        return cls(**common)


def slurm_fields(env: Mapping[str, str]) -> dict[str, object]:
    """DistEnv fields of a task started by ``srun`` (step values first)."""
    world = _int(env, "SLURM_STEP_NUM_TASKS", None) or _int(env, "SLURM_NTASKS", 1) or 1
    node = _int(env, "SLURM_NODEID", 0) or 0
    per_node = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE")
    local_size = _int(env, "SLURM_NTASKS_PER_NODE", None)
    if per_node:
        try:
            counts = expand_counts(per_node)
        except ValueError as exc:
            raise DsrunError(f"SLURM_STEP_TASKS_PER_NODE: {exc}") from None
        if node < len(counts):
            local_size = counts[node]
    nodelist = (env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST")
                or env.get("SLURM_NODELIST") or "")
    try:
        nodes = tuple(expand_hostlist(nodelist))
    except ValueError as exc:
        raise DsrunError(f"SLURM_STEP_NODELIST: {exc}") from None
    job = _int(env, "SLURM_JOB_ID", None) or _int(env, "SLURM_JOBID", None)
    step = _int(env, "SLURM_STEP_ID", 0) or _int(env, "SLURM_STEPID", 0) or 0
    return dict(rank=_int(env, "SLURM_PROCID", 0) or 0, world_size=world,
                local_rank=_int(env, "SLURM_LOCALID", 0) or 0,
                local_world_size=local_size or world, source="Slurm", rendezvous="slurm",
                nodes=nodes, slurm_job=(job, step) if job is not None else None)


def slurm_port(job_id: int, step_id: int) -> int:
    """The master port of a job step started by srun without MASTER_PORT:
    the same on every task, different for concurrent steps of one job and
    (mostly) for jobs sharing a node."""
    return SLURM_PORT_BASE + (job_id * 16 + step_id) % SLURM_PORT_SPAN


def _int(env: Mapping[str, str], key: str, default: int | None) -> int | None:
    value = env.get(key)
    if value is None or value == "":
        return default
    try:
        return int(value.split("(")[0])  # SLURM_NTASKS_PER_NODE may read "2(x3)"
    except ValueError:
        raise DsrunError(f"environment variable {key}={value!r} is not an integer") from None
