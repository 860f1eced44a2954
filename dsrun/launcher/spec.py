"""LaunchSpec: what the user asked for, validated, independent of click.

cli.py turns argv into a LaunchSpec; nothing below the CLI sees click.
:class:`HostsSpec` is the part that says where a job runs (hostfile,
selection, rendezvous, SSH); ``dsrun doctor`` uses it on its own.
"""

from __future__ import annotations

import math
import shlex
from collections.abc import Mapping
from dataclasses import dataclass, field

from dsrun.errors import DsrunUsageError
from dsrun.launcher.cores import parse_cpu_list
from dsrun.launcher.hostfile import MAX_SLOTS

# Spellings of the argument DeepSpeed's launcher (--local_rank) and
# torch.distributed.launch >= 2.0 (--local-rank) append to a script's argv.
LOCAL_RANK_FLAGS = (None, "--local_rank", "--local-rank")

DIST_BACKENDS = ("nccl", "gloo", "mpi", "none")
#: Launchers whose ranks MPI knows (mpirun, srun): torch's MPI backend takes
#: rank and world size from MPI itself, so under the others (local, ssh:
#: no mpirun) every rank would be a world of its own.
MPI_LAUNCHERS = ("openmpi", "slurm")

# On a host without GPUs and without --num_gpus, dsrun starts this many CPU
# ranks (fewer if the host has fewer CPUs): enough to exercise data
# parallelism, few enough not to oversubscribe a laptop.
DEFAULT_CPU_RANKS = 2
#: Seconds to wait for an SSH connection (and a remote agent's first answer).
DEFAULT_SSH_TIMEOUT = 10.0
#: Seconds of silence after which a host (launcher side) or the launcher
#: (agent side) is declared lost; heartbeats flow every quarter of it.
DEFAULT_HEARTBEAT_TIMEOUT = 15.0
#: --launcher names (the backend registry has one entry per name) and aliases.
#: ``pdsh`` is DeepSpeed's default launcher: dsrun's ``ssh`` backend
#: (paramiko, no pdsh binary) does its job, so the name means ``ssh``.
LAUNCHERS = ("local", "openmpi", "slurm", "ssh")
LAUNCHER_ALIASES = {"mpirun": "openmpi", "pdsh": "ssh"}
#: DeepSpeed launchers dsrun has no backend for, and what to do instead.
UNSUPPORTED_LAUNCHERS = dict.fromkeys(
    ("mvapich", "impi", "mpich"),
    "dsrun drives Open MPI's mpirun (--launcher openmpi) and Slurm's srun (--launcher "
    "slurm); with MVAPICH, Intel MPI or MPICH, start the ranks with that MPI's own mpirun "
    "and plain python (dsrun's runtime reads their MV2_/PMI_ rank variables), or use "
    "--launcher ssh")
#: The longest span a seconds option (--timeout, --kill_grace, ...) takes:
#: 10**8 s is over three years. Longer is a typo, and timers overflow near
#: 9.2e9 s (``threading.TIMEOUT_MAX``).
MAX_SECONDS = 1e8


def check_seconds(option: str, value: float, *, zero: bool) -> None:
    """A usage error unless ``value`` is a finite number of seconds in
    ``0..MAX_SECONDS`` (``zero``: 0 is allowed, else it must be > 0). NaN
    must be caught here: every comparison with it is false, so a NaN grace
    or deadline would never expire."""
    if not math.isfinite(value):
        raise DsrunUsageError(f"{option} must be a finite number of seconds, got {value}")
    if value < 0 or (value == 0 and not zero):
        bound = ">= 0" if zero else "> 0"
        raise DsrunUsageError(f"{option} must be {bound} seconds, got {value:g}")
    if value > MAX_SECONDS:
        raise DsrunUsageError(f"{option} must be at most {MAX_SECONDS:.0e} seconds (over "
                              f"three years), got {value:g}")


def launcher_name(name: str | None) -> str | None:
    """The backend a --launcher value names (any case, aliases resolved), or a
    usage error."""
    if name is None:
        return None
    lowered = name.lower()  # DeepSpeed lower-cases it too
    if lowered in UNSUPPORTED_LAUNCHERS:
        raise DsrunUsageError(f"--launcher {name!r} is not supported: "
                              f"{UNSUPPORTED_LAUNCHERS[lowered]}")
    canonical = LAUNCHER_ALIASES.get(lowered, lowered)
    if canonical not in LAUNCHERS:
        choices = ", ".join(sorted((*LAUNCHERS, *(f"{a} (= {b})" for a, b in
                                                   LAUNCHER_ALIASES.items()))))
        raise DsrunUsageError(f"--launcher {name!r} does not exist; choose one of {choices}")
    return canonical


def split_args(value: str | None, option: str) -> tuple[str, ...]:
    """A shell-quoted option string (--launcher_args, --slurm_args) as argv words."""
    if value is None:
        return ()
    try:
        return tuple(shlex.split(value))
    except ValueError as exc:
        raise DsrunUsageError(f"{option} {value!r}: {exc}") from None


def cpu_by_deepspeed_variable(environ: Mapping[str, str]) -> bool:
    """DeepSpeed's ``DS_ACCELERATOR=cpu`` in the launcher's environment: CPU
    ranks, as ``--cpu`` asks (DeepSpeed then trains on the CPU too)."""
    return environ.get("DS_ACCELERATOR", "").strip().lower() == "cpu"


_NOT_PDSH = ("dsrun's ssh launcher (DeepSpeed's pdsh) starts hosts with paramiko, not "
             "pdsh, so pdsh options (such as -f fan-out) have no equivalent; SSH settings "
             "go in the --ssh_* options or ssh_config")
#: What to do instead of --launcher_args, by launcher.
LAUNCHER_ARGS_INSTEAD: dict[str | None, str] = {
    "slurm": "srun options go in --slurm_args", "ssh": _NOT_PDSH,
    "local": "the local launcher starts the ranks on this host itself, with no tool to pass "
             "options to",
    # Not known yet whether any host is remote: both cases in one sentence.
    None: "the default launcher starts ranks on this host itself and other hosts over "
          "SSH with paramiko, not pdsh, so there is no tool to pass options to; SSH "
          "settings go in the --ssh_* options or ssh_config"}


@dataclass(frozen=True)
class SshOptions:
    """How to reach remote hosts; None means "from ssh_config, else default"."""

    port: int | None = None
    user: str | None = None
    key: str | None = None
    config: str | None = None  # None: ~/.ssh/config when it exists
    insecure: bool = False  # accept unknown host keys (never saved)
    timeout: float = DEFAULT_SSH_TIMEOUT
    #: --ssh_timeout was on the command line: then it wins
    #: over ssh_config's ConnectTimeout, also when it equals the default.
    timeout_given: bool = False

    def __post_init__(self) -> None:
        if self.port is not None and not 1 <= self.port <= 65535:
            raise DsrunUsageError(f"--ssh_port must be in 1..65535, got {self.port}")
        check_seconds("--ssh_timeout", self.timeout, zero=False)


@dataclass(frozen=True)
class HostsSpec:
    """Where a job runs: hostfile and selection, rendezvous, launcher, SSH."""

    hostfile: str | None = None  # None: ./hostfile, else /job/hostfile, else local
    include: str | None = None
    exclude: str | None = None
    num_nodes: int | None = None
    num_gpus: int | None = None
    master_addr: str | None = None
    master_port: int | None = None
    launcher: str | None = None  # None: ssh when a selected host is not this one
    ssh: SshOptions = field(default_factory=SshOptions)
    cpu: bool = False  # --cpu: CPU ranks with gloo even on hosts that have GPUs
    launcher_args: tuple[str, ...] = ()  # appended verbatim to mpirun's argv
    slurm_args: tuple[str, ...] = ()  # srun options (an allocation, a partition, ...)

    def __post_init__(self) -> None:
        if self.include is not None and self.exclude is not None:
            raise DsrunUsageError("--include and --exclude are mutually exclusive")
        object.__setattr__(self, "launcher", launcher_name(self.launcher))
        if self.launcher_args and self.launcher != "openmpi":
            raise DsrunUsageError(f"--launcher_args is for --launcher openmpi (mpirun), not "
                                  f"{self.launcher or 'the default launcher'}; "
                                  f"{LAUNCHER_ARGS_INSTEAD.get(self.launcher, _NOT_PDSH)}")
        if self.slurm_args and self.launcher != "slurm":
            raise DsrunUsageError("--slurm_args needs --launcher slurm")
        for name in ("num_gpus", "num_nodes"):
            if getattr(self, name) == -1:  # DeepSpeed's default value: all of them
                object.__setattr__(self, name, None)
        if self.num_gpus is not None and self.num_gpus < 1:
            raise DsrunUsageError(f"--num_gpus must be at least 1 (or -1: all, as in "
                                  f"DeepSpeed), got {self.num_gpus}")
        if self.num_gpus is not None and self.num_gpus > MAX_SLOTS:
            raise DsrunUsageError(f"--num_gpus must be at most {MAX_SLOTS} (ranks on one "
                                  f"host), got {self.num_gpus}")
        if self.num_nodes is not None and self.num_nodes < 1:
            raise DsrunUsageError(f"--num_nodes must be at least 1 (or -1: all, as in "
                                  f"DeepSpeed), got {self.num_nodes}")
        if self.master_port is not None and not 1 <= self.master_port <= 65535:
            raise DsrunUsageError(f"--master_port must be in 1..65535, got {self.master_port}")


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
    kill_grace: float = 30.0  # as DeepSpeed's launcher, torchrun and Slurm's KillWait
    dist_backend: str | None = None
    backend: str | None = None  # --launcher; None: chosen from the hosts
    extra_env: tuple[tuple[str, str], ...] = field(default=())
    hostfile: str | None = None
    include: str | None = None
    exclude: str | None = None
    env_prefixes: tuple[str, ...] = ()
    preflight: bool = True
    ssh: SshOptions = field(default_factory=SshOptions)
    config: str | None = None  # a DeepSpeed-style JSON config handed to every rank
    local_rank_arg: str | None = None  # "--local_rank" / "--local-rank" appended per rank
    cpu: bool = False  # --cpu: CPU ranks with gloo even on hosts that have GPUs
    launcher_args: tuple[str, ...] = ()
    slurm_args: tuple[str, ...] = ()
    no_local_rank: bool = False  # --no_local_rank: never fill in --local_rank
    timeout: float | None = None  # --timeout: end the job after this many seconds
    heartbeat_timeout: float = DEFAULT_HEARTBEAT_TIMEOUT  # 0: no heartbeats
    bind_cores_to_rank: bool = False  # each rank on its own share of the host's CPUs
    bind_core_list: str | None = None  # "0-7,16-23": share these CPUs (implies binding)

    def __post_init__(self) -> None:
        if self.bind_core_list is not None:
            parse_cpu_list(self.bind_core_list)  # one clear error before anything starts
            object.__setattr__(self, "bind_cores_to_rank", True)
        if self.module and self.no_python:
            raise DsrunUsageError("--module and --no_python cannot be used together")
        if self.no_local_rank and self.local_rank_arg:
            raise DsrunUsageError("--no_local_rank contradicts --local_rank_arg "
                                  "(--local-rank-arg): pass one of them")
        if self.timeout is not None:
            check_seconds("--timeout", self.timeout, zero=False)
        check_seconds("--heartbeat_timeout", self.heartbeat_timeout, zero=True)
        check_seconds("--kill_grace", self.kill_grace, zero=True)
        if 0 < self.heartbeat_timeout < 1:
            raise DsrunUsageError(f"--heartbeat_timeout {self.heartbeat_timeout:g} is too short "
                                  f"to tell a slow host from a lost one: use 1 or more (0: off)")
        if self.local_rank_arg not in LOCAL_RANK_FLAGS:
            raise DsrunUsageError(f"--local_rank_arg must be --local_rank or --local-rank, "
                                  f"got {self.local_rank_arg!r}")
        object.__setattr__(self, "backend", launcher_name(self.backend))
        self.hosts  # noqa: B018 - validates the host options
        if self.max_restarts < 0:
            raise DsrunUsageError(f"--max_restarts must be >= 0, got {self.max_restarts}")
        if self.cpu and self.dist_backend == "nccl":
            raise DsrunUsageError("--cpu asks for CPU ranks, which cannot use "
                                  "--dist_backend nccl (use gloo or none)")
        if self.dist_backend is not None and self.dist_backend not in DIST_BACKENDS:
            raise DsrunUsageError(
                f"--dist_backend must be one of {', '.join(DIST_BACKENDS)}, "
                f"got {self.dist_backend!r}"
            )
        if self.dist_backend == "mpi" and self.backend not in MPI_LAUNCHERS:
            raise DsrunUsageError(
                f"--dist_backend mpi needs --launcher openmpi or slurm, not "
                f"{self.backend or 'the default launcher'}: torch's MPI backend takes rank "
                f"and world size from MPI, so without mpirun or srun each rank would be a "
                f"world of 1 (it also needs a torch built with MPI; pip's wheels are not). "
                f"Leave --dist_backend out: gloo on CPU ranks, NCCL on GPU ranks")

    @property
    def hosts(self) -> HostsSpec:
        return HostsSpec(self.hostfile, self.include, self.exclude, self.num_nodes,
                         self.num_gpus, self.master_addr, self.master_port, self.backend,
                         self.ssh, self.cpu, self.launcher_args, self.slurm_args)
