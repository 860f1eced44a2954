"""DistEnv: where this rank sits in the job, read once from the environment.

Sources, in order: dsrun's (and torchrun's) variables RANK/WORLD_SIZE/...,
then Open MPI's OMPI_COMM_WORLD_*, then PMI_RANK/PMI_SIZE, then Slurm's
SLURM_PROCID/SLURM_NTASKS, else a single process. The object is frozen;
the runtime never writes os.environ.

``accelerator`` is ``DSRUN_ACCELERATOR``: ``"cpu"`` when the launcher was
asked for CPU ranks (``dsrun --cpu``), which then use gloo even where CUDA
is present.

``config_path`` is ``DSRUN_CONFIG``: the training config (DeepSpeed JSON)
the launcher hands every rank (``dsrun --config``); ``dsrun.initialize``
uses it when the script passes none.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from dsrun.errors import DsrunError

# (source name, rank var, size var, local rank var, local size var)
_SOURCES = (
    ("dsrun/torchrun", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"),
    ("Open MPI", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
     "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"),
    ("PMI", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"),
    ("Slurm", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_NTASKS_PER_NODE"),
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
    backend: str | None = None  # DSRUN_DIST_BACKEND, if the launcher set one
    job_id: str | None = None
    restart_count: int = 0
    error_file: str | None = None
    config_path: str | None = None  # DSRUN_CONFIG, a launcher-given training config
    accelerator: str | None = None  # DSRUN_ACCELERATOR: "cpu" under dsrun --cpu

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world_size:
            raise DsrunError(f"rank {self.rank} outside world size {self.world_size} "
                             f"(from {self.source} environment)")

    @classmethod
    def detect(cls, environ: Mapping[str, str] | None = None) -> DistEnv:
        env = os.environ if environ is None else environ
        common = dict(
            master_addr=env.get("MASTER_ADDR") or None,
            master_port=_int(env, "MASTER_PORT", None),
            backend=env.get("DSRUN_DIST_BACKEND") or None,
            job_id=env.get("DSRUN_JOB_ID") or None,
            restart_count=_int(env, "DSRUN_RESTART_COUNT", 0) or 0,
            error_file=env.get("DSRUN_ERROR_FILE") or None,
            config_path=env.get("DSRUN_CONFIG") or None,
            accelerator=env.get("DSRUN_ACCELERATOR") or None,
        )
        for source, rank, size, lrank, lsize in _SOURCES:
            if rank in env and size in env:
                world = _int(env, size, 1) or 1
                return cls(rank=_int(env, rank, 0) or 0, world_size=world,
                           local_rank=_int(env, lrank, 0) or 0,
                           local_world_size=_int(env, lsize, world) or world,
                           source=source, **common)
        return cls(**common)


def _int(env: Mapping[str, str], key: str, default: int | None) -> int | None:
    value = env.get(key)
    if value is None or value == "":
        return default
    try:
        return int(value.split("(")[0])  # SLURM_NTASKS_PER_NODE may read "2(x3)"
    except ValueError:
        raise DsrunError(f"environment variable {key}={value!r} is not an integer") from None
