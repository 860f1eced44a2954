"""LaunchSpec: what the user asked for, validated, independent of click.

cli.py turns argv into a LaunchSpec; nothing below the CLI sees click.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from dsrun.errors import DsrunUsageError

DIST_BACKENDS = ("nccl", "gloo", "mpi", "none")

# On a host without GPUs and without --num_gpus, dsrun starts this many CPU
# ranks (fewer if the host has fewer CPUs): enough to exercise data
# parallelism, few enough not to oversubscribe a laptop.
DEFAULT_CPU_RANKS = 2


@dataclass(frozen=True)
class LaunchSpec:
    """A validated launch request."""

    script: str
    script_args: tuple[str, ...] = ()
    module: bool = False
    no_python: bool = False
    num_gpus: int | None = None
    num_nodes: int | None = None
    master_addr: str | None = None
    master_port: int | None = None
    log_dir: str | None = None
    dry_run: bool = False
    max_restarts: int = 0
    kill_grace: float = 5.0
    dist_backend: str | None = None
    backend: str = "local"
    extra_env: tuple[tuple[str, str], ...] = field(default=())

    def __post_init__(self) -> None:
        if self.module and self.no_python:
            raise DsrunUsageError("--module and --no_python cannot be used together")
        if self.num_gpus is not None and self.num_gpus < 1:
            raise DsrunUsageError(f"--num_gpus must be at least 1, got {self.num_gpus}")
        if self.num_nodes is not None and self.num_nodes < 1:
            raise DsrunUsageError(f"--num_nodes must be at least 1, got {self.num_nodes}")
        if self.master_port is not None and not 1 <= self.master_port <= 65535:
            raise DsrunUsageError(f"--master_port must be in 1..65535, got {self.master_port}")
        if self.max_restarts < 0:
            raise DsrunUsageError(f"--max_restarts must be >= 0, got {self.max_restarts}")
        if self.kill_grace < 0:
            raise DsrunUsageError(f"--kill_grace must be >= 0, got {self.kill_grace}")
        if self.dist_backend is not None and self.dist_backend not in DIST_BACKENDS:
            raise DsrunUsageError(
                f"--dist_backend must be one of {', '.join(DIST_BACKENDS)}, "
                f"got {self.dist_backend!r}"
            )
