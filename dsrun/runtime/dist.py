"""Bringing up torch.distributed from a DistEnv.

``init_distributed()`` is what the bootstrap calls before the user's first
line, and what scripts started some other way (plain python, torchrun,
``mpirun``, ``srun``) may call themselves; when a default process group
exists it keeps it, whatever backend it asks for (as DeepSpeed's
``init_distributed``, which wraps an existing group), and only sets a
``timeout`` it is given on it: under dsrun the group exists before the
script runs, and the script's timeout is what it would have been made
with. World size 1 without a rendezvous address uses an in-memory store:
no ports.

The group's collective timeout, when the call gives none: DeepSpeed's
``DEEPSPEED_TIMEOUT`` (minutes; read by :func:`timeout_from_env`) where it
is set, else torch's default (30 minutes for gloo, 10 for NCCL; DeepSpeed's
own default is 10 minutes for both).

A rank that ``init_distributed`` placed from MPI's or Slurm's variables
(started by plain ``mpirun``/``srun``) gets ``RANK``, ``LOCAL_RANK``,
``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT`` in ``os.environ`` once
its group is up, those not set already (:func:`discovered_variables`): what
DeepSpeed's ``init_distributed`` exports after its MPI discovery, which
scripts and Hugging Face's ``TrainingArguments`` read. It is the one place
the runtime writes ``os.environ``, at the script's own call, and documented
(README, "Rank discovery in the runtime").

NCCL on a rank without a GPU (CPU ranks: no CUDA, or ``dsrun --cpu``) is
refused by :func:`check_backend` with one :class:`DsrunError` that says
what to do, before anything is changed: whether ``init_distributed``
would create the group or a script's own
``torch.distributed.init_process_group(backend="nccl")`` would replace
dsrun's gloo group (which is kept, working, for the error report).

Backend and device, the same rule everywhere (DeepSpeed's):

* A group "is NCCL" when it runs NCCL for CUDA tensors, read from
  ``dist.get_backend_config()`` by the pure :func:`uses_nccl`: ``"nccl"``
  (config ``cuda:nccl``), ``"cpu:gloo,cuda:nccl"``, and a group made with no
  backend on a GPU host (``get_backend()`` says ``"undefined"``, the config
  ``cuda:nccl``). Plain gloo's config is ``cpu:gloo,cuda:gloo``: not NCCL.
* dsrun's own choice is NCCL when ``torch.cuda.is_available()`` (the same on
  every rank, so no job mixes NCCL and gloo ranks) and the launcher did not
  ask for CPU ranks.
* The rank's GPU (:func:`local_device_index`, pure): its local rank when it
  sees that many devices (the launcher gives every rank the node's devices),
  device 0 when it sees exactly one (``srun --gpus-per-task=1`` and other
  per-task binding), else one error naming the local rank, the count and
  ``CUDA_VISIBLE_DEVICES``.
* On an NCCL group :func:`compute_device` also makes that GPU the current
  device, as DeepSpeed's engine does (``_set_distributed_vars``), so a script
  that made its group itself (torchrun, ``srun``, ``mpirun``) without
  ``torch.cuda.set_device`` does not put every rank on GPU 0; the engine,
  ``zero.Init`` and the memory statistics all use this device. A device the
  script chose itself (the group's ``device_id``, or a current device other
  than 0) is kept (:func:`choose_cuda_device`).
"""

from __future__ import annotations

import atexit
import datetime
import inspect
import logging
import os
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist

from dsrun.errors import DsrunError
from dsrun.runtime import rendezvous
from dsrun.runtime.env import DistEnv
from dsrun.runtime.progress import ensure_visible

log = logging.getLogger("dsrun.runtime")

_original_init = dist.init_process_group
_owned_by_dsrun = False
_group_pid = os.getpid()  # the process whose group shutdown() may destroy
#: DeepSpeed's variable for the default process-group timeout, in minutes.
TIMEOUT_VARIABLE = "DEEPSPEED_TIMEOUT"
#: What DeepSpeed's MPI discovery exports (deepspeed/comm/comm.py:mpi_discovery).
DISCOVERED = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
              "MASTER_PORT")


def backend_by_device(config: str | None) -> dict[str, str]:
    """A backend spec or ``dist.get_backend_config()``'s string as
    ``{device type: backend}`` (pure): ``"cpu:gloo,cuda:nccl"``; a bare
    name (``"nccl"``) maps ``""``."""
    text = str(config or "").strip().lower()
    if ":" not in text:
        return {"": text}
    return dict(part.split(":", 1) for part in text.split(",") if ":" in part)


def cuda_backend(spec: str | None) -> str | None:
    """The backend that ``spec`` uses for CUDA tensors (pure), or None.

    ``spec`` is a backend as ``init_process_group`` takes it (``"nccl"``,
    ``"GLOO"``, ``"cpu:gloo,cuda:nccl"``) or a group's
    ``dist.get_backend_config()`` (``"cuda:nccl"``, ``"cpu:gloo,cuda:gloo"``,
    ``"cpu:gloo"``). None when it names none for CUDA: ``"cpu:gloo"``, and
    ``None``/``""``/``"undefined"`` (torch then picks by the accelerator).
    """
    per_device = backend_by_device(spec)
    backend = per_device.get("cuda", per_device.get(""))
    return None if backend in (None, "", "undefined") else backend


def uses_nccl(spec: str | None) -> bool:
    """Whether ``spec`` (see :func:`cuda_backend`) runs NCCL for CUDA tensors."""
    return cuda_backend(spec) == "nccl"


def group_uses_nccl(group: Any = None) -> bool:
    """Whether ``group`` (default: the default group) exists and runs NCCL
    for CUDA tensors (from its backend config, not ``get_backend()``)."""
    return dist.is_available() and dist.is_initialized() and \
        uses_nccl(dist.get_backend_config(group))


def rank_has_gpu(env: DistEnv) -> bool:
    """Whether this rank trains on a GPU: CUDA is available and the launcher
    did not ask for CPU ranks (``dsrun --cpu``). Not the local rank against the
    device count: that differs between ranks under per-task GPU binding, and
    every rank must choose the same backend."""
    if env.accelerator == "cpu":
        return False
    return torch.cuda.is_available()


def default_backend(env: DistEnv) -> str:
    """nccl when this rank has a GPU, gloo otherwise (unless the launcher chose);
    gloo for CPU ranks asked for with ``dsrun --cpu`` (``env.accelerator``)."""
    if env.backend and env.backend != "none":
        return env.backend
    return "nccl" if rank_has_gpu(env) else "gloo"


def local_device_index(local_rank: int, visible: int, cuda_visible_devices: str | None,
                       source: str = "the launcher") -> int:
    """The CUDA device index of a rank (pure; the module docstring's rule):
    ``local_rank`` when ``visible`` devices include it, 0 when the rank sees
    exactly one (per-task binding), else a :class:`DsrunError`."""
    if 0 <= local_rank < visible:
        return local_rank
    if visible == 1:
        return 0
    raise DsrunError(
        f"local rank {local_rank} (LOCAL_RANK, from {source}) has no GPU of its own: torch "
        f"sees {visible} CUDA device(s) (CUDA_VISIBLE_DEVICES={cuda_visible_devices!r}). "
        f"Give every rank of a node all of the node's GPUs (one per local rank), or each "
        f"rank exactly one (srun --gpus-per-task=1), or start fewer ranks per node")


def cuda_device_index(env: DistEnv) -> int:
    """This rank's CUDA device index (:func:`local_device_index` on torch's count)."""
    return local_device_index(env.local_rank, torch.cuda.device_count(),
                              env.cuda_visible_devices, env.source)


def check_backend(backend: str, env: DistEnv, asked_by: str) -> None:
    """Refuse a backend this rank cannot run (NCCL without a GPU, or without a
    GPU of its own; MPI in a torch built without it), naming ``asked_by`` (the
    call that asked) and what to do."""
    if "mpi" in backend_by_device(backend).values() and not dist.is_mpi_available():
        # torch's own error is a traceback from deep inside init_process_group
        raise DsrunError(
            f"{asked_by} asked for the MPI backend, but this torch ({torch.__version__}) "
            f"was built without MPI (torch.distributed.is_mpi_available() is False; pip's "
            f"wheels never have it): leave the backend out (gloo on CPU ranks, NCCL on GPU "
            f"ranks), or build torch from source against an MPI library")
    if not uses_nccl(backend):
        return
    if rank_has_gpu(env):
        cuda_device_index(env)  # raises when the local rank has no device
        return
    why = "dsrun --cpu asked for CPU ranks" if env.accelerator == "cpu" else \
        "torch sees no CUDA device (torch.cuda.is_available() is False)"
    raise DsrunError(
        f"{asked_by} asked for the NCCL backend, but NCCL needs GPUs and rank {env.rank} is a "
        f"CPU rank ({why}); CPU ranks communicate with gloo. Leave the backend out (dsrun "
        f"starts gloo on CPU ranks and NCCL on GPU ranks), or pass backend=\"gloo\", or "
        f"\"nccl\" if torch.cuda.is_available() else \"gloo\"")


def choose_cuda_device(current: int, bound: int | None, expected: Callable[[], int]) -> int:
    """The device a rank of an existing NCCL group trains on (pure): the
    group's bound device (``init_process_group(device_id=...)``), else the
    current device when the script chose one (not 0, the default), else
    ``expected()`` (:func:`cuda_device_index`; called only then, as it may
    raise)."""
    if bound is not None:
        return bound
    if current != 0:
        return current
    return expected()


def compute_device(env: DistEnv | None = None) -> torch.device:
    """The device this rank trains on: its GPU when the default process group
    runs NCCL for CUDA tensors, else the CPU (gloo ranks, also on hosts with
    GPUs). On an NCCL group that GPU is made the current device (module
    docstring); ``env`` is read from the environment when not given."""
    if not group_uses_nccl():
        return torch.device("cpu")
    bound = getattr(dist.distributed_c10d._get_default_group(), "bound_device_id", None)
    current = torch.cuda.current_device()
    index = choose_cuda_device(
        current, bound.index if bound is not None and bound.type == "cuda" else None,
        lambda: cuda_device_index(env or DistEnv.detect(mpi_size=_mpi_world_size)))
    if index != current:
        torch.cuda.set_device(index)
        log.debug("NCCL group made outside dsrun: cuda:%d is now the current device (was "
                  "cuda:%d)", index, current)
    return torch.device("cuda", index)


def timeout_from_env(environ: Mapping[str, str]) -> datetime.timedelta | None:
    """``DEEPSPEED_TIMEOUT`` (whole minutes, as DeepSpeed reads it) as a
    timedelta; None when it is unset or empty."""
    value = environ.get(TIMEOUT_VARIABLE, "").strip()
    if not value:
        return None
    try:
        minutes = int(value)
    except ValueError:
        minutes = 0
    if minutes <= 0:
        raise DsrunError(f"{TIMEOUT_VARIABLE}={environ[TIMEOUT_VARIABLE]!r}: the process "
                         f"group's timeout is a whole number of minutes, at least 1")
    return datetime.timedelta(minutes=minutes)


def init_distributed(backend: str | None = None, timeout: datetime.timedelta | None = None,
                     env: DistEnv | None = None, **compat: Any) -> None:
    """Initialise the default process group unless one exists; with one,
    set ``timeout`` on it when given (module docstring).

    Where the rank and the master come from: env.py and rendezvous.py
    (dsrun's variables, else MPI or Slurm; world size 1 needs nothing).
    DeepSpeed's keyword arguments are accepted: ``dist_backend`` (as
    ``backend``), ``distributed_port`` (the port when the master is found
    through MPI or Slurm; by default a free one / one derived from the
    Slurm job), ``init_method``, ``rank`` and ``world_size``; the others
    (``auto_mpi_discovery``, ``verbose``, ...) have no effect. Without
    ``timeout`` a new group gets ``DEEPSPEED_TIMEOUT``'s, else torch's default.
    """
    global _owned_by_dsrun, _group_pid
    if dist.is_initialized():
        _note_kept_group(backend or compat.get("dist_backend"))
        if timeout is not None:
            dist.distributed_c10d._set_pg_timeout(timeout)
            log.debug("init_distributed: timeout %s set on the existing group", timeout)
        compute_device(env)  # an NCCL group made by the script: its rank's GPU
        return
    if timeout is None:
        timeout = timeout_from_env(os.environ)
    env = env or DistEnv.detect(mpi_size=_mpi_world_size)
    asked = backend or compat.get("dist_backend")
    backend = asked or default_backend(env)
    check_backend(backend, env, f"init_distributed(dist_backend={asked!r})" if asked
                  else f"dsrun --dist_backend {backend} (DSRUN_DIST_BACKEND)")
    rank = compat.get("rank", -1)
    world = compat.get("world_size", -1)
    kwargs: dict[str, Any] = {"backend": backend,
                              "rank": rank if rank is not None and rank >= 0 else env.rank,
                              "world_size": world if world and world > 0 else env.world_size}
    if timeout is not None:
        kwargs["timeout"] = timeout
    for key in ("device_id", "pg_options"):  # a script's own, when it re-creates the group
        if compat.get(key) is not None:
            kwargs[key] = compat[key]
    if uses_nccl(backend):
        torch.cuda.set_device(cuda_device_index(env))
    how, master = _rendezvous(env, backend, timeout, compat)
    kwargs.update(how)
    _original_init(**kwargs)
    _owned_by_dsrun = True
    _group_pid = os.getpid()
    for key, value in discovered_variables(env, kwargs["rank"], kwargs["world_size"],
                                           master).items():
        os.environ.setdefault(key, value)  # never one the user or a launcher set
    # A group still up at interpreter teardown can abort the process from
    # gloo's threads; scripts that never destroy it get it destroyed here.
    atexit.register(shutdown)
    log.debug("process group up: rank %d/%d backend %s (from %s)", env.rank, env.world_size,
              backend, env.source)


def _note_kept_group(asked: str | None) -> None:
    """init_distributed with a group up keeps it, as DeepSpeed's does; say
    so (rank 0) when the call named another backend."""
    have = dist.get_backend()
    if asked and str(asked).lower() != have and dist.get_rank() == 0:
        # Scripts call this before initialize(), which would make the
        # runtime's logger visible: without a handler the line is lost.
        ensure_visible()
        log.info("init_distributed(dist_backend=%r): the process group exists already "
                 "(backend %s) and is kept, as DeepSpeed keeps an existing group", asked, have)


def discovered_variables(env: DistEnv, rank: int, world_size: int,
                         master: tuple[str, int] | None) -> dict[str, str]:
    """The variables :func:`init_distributed` exports (pure; module docstring):
    none when the rank came from ``RANK``/``WORLD_SIZE`` (dsrun, torchrun) or
    is a single process; ``MASTER_*`` only when a master was used."""
    if env.rendezvous not in ("mpi", "slurm"):
        return {}
    # LOCAL_WORLD_SIZE too (torchrun's; DeepSpeed exports no such variable),
    # so a DistEnv read after the call still knows the ranks on this host
    values = {"RANK": str(rank), "LOCAL_RANK": str(env.local_rank),
              "WORLD_SIZE": str(world_size), "LOCAL_WORLD_SIZE": str(env.local_world_size)}
    if master is not None:
        values.update(MASTER_ADDR=master[0], MASTER_PORT=str(master[1]))
    return values


def _rendezvous(env: DistEnv, backend: str, timeout: datetime.timedelta | None,
                compat: dict[str, Any]) -> tuple[dict[str, Any], tuple[str, int] | None]:
    """``init_method`` or ``store`` for init_process_group, and the master
    (address, port) when there is one to name (not for an ``init_method``
    the script gave, nor a world of one)."""
    if compat.get("init_method"):
        return {"init_method": compat["init_method"]}, None
    port = compat.get("distributed_port")
    if env.master_known:
        assert env.master_addr is not None and env.master_port is not None
        if env.job_id and env.world_size > 1:
            # a dsrun job: a store that refuses another job's ranks (rendezvous.py)
            wait = timeout or dist.distributed_c10d._get_default_timeout(backend)
            return ({"store": rendezvous.job_store(env, wait)},
                    (env.master_addr, env.master_port))
        host = f"[{env.master_addr}]" if ":" in env.master_addr else env.master_addr
        return ({"init_method": f"tcp://{host}:{env.master_port}"},
                (env.master_addr, env.master_port))
    if env.world_size == 1:
        return {"store": dist.HashStore()}, None
    if env.rendezvous == "mpi":
        store, addr, port = rendezvous.mpi_store(env, backend, port, timeout)
        return {"store": store}, (addr, port)
    if env.rendezvous == "slurm":
        addr, port = rendezvous.slurm_master(env, backend, port)
        host = f"[{addr}]" if ":" in addr else addr
        return {"init_method": f"tcp://{host}:{port}"}, (addr, port)
    raise DsrunError(
        f"world size {env.world_size} (from {env.source}) but MASTER_ADDR/MASTER_PORT "
        f"are not set: start the job with dsrun, mpirun or srun, or set them")


def _mpi_world_size() -> int:
    return int(rendezvous.mpi_comm().Get_size())


def _requested(args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    """The arguments of an init_process_group call, by name."""
    bound = inspect.signature(_original_init).bind_partial(*args, **kwargs)
    return dict(bound.arguments)


def _same_device(device_id: Any) -> bool:
    """Whether ``device_id`` is the device dsrun's group already uses."""
    wanted = torch.device("cuda", device_id) if isinstance(device_id, int) \
        else torch.device(device_id)
    current = compute_device()
    return wanted.type == current.type and (wanted.index is None or current.index is None
                                            or wanted.index == current.index)


def tolerant_init_process_group(*args: Any, **kwargs: Any) -> None:
    """Stands in for ``torch.distributed.init_process_group`` inside dsrun ranks.

    Scripts written for torchrun call it themselves. The group dsrun already
    made is kept when it matches, and what the call asks for is applied:

    - another ``backend``, ``pg_options``, or a ``device_id`` other than the
      rank's device: the group is replaced by one made with these arguments
      (over dsrun's rendezvous);
    - ``timeout``: set on the existing group;
    - ``rank``/``world_size`` other than the group's: a warning (the
      launcher's values stay; a script that computes them differently has
      a bug to know about);
    - ``init_method``/``store``/``group_name``: the rendezvous is dsrun's.
    """
    global _owned_by_dsrun
    if not (dist.is_initialized() and _owned_by_dsrun):
        _original_init(*args, **kwargs)
        return
    req = _requested(args, kwargs)
    backend = req.get("backend")
    wanted = str(backend).lower() if backend else dist.get_backend()
    device_id, pg_options = req.get("device_id"), req.get("pg_options")
    if wanted != dist.get_backend() or pg_options is not None or \
            (device_id is not None and not _same_device(device_id)):
        check_backend(wanted, DistEnv.detect(mpi_size=_mpi_world_size),
                      f"torch.distributed.init_process_group(backend={backend!r})")
        dist.destroy_process_group()
        _owned_by_dsrun = False
        init_distributed(backend=wanted, timeout=req.get("timeout"),
                         device_id=device_id, pg_options=pg_options)
        return
    if req.get("timeout") is not None:
        dist.distributed_c10d._set_pg_timeout(req["timeout"])
        log.debug("init_process_group: timeout %s set on the existing group", req["timeout"])
    for key, have in (("rank", dist.get_rank()), ("world_size", dist.get_world_size())):
        given = req.get(key)
        if given is not None and given != -1 and given != have:
            log.warning("init_process_group(%s=%s) ignored: this rank's %s is %s (from the "
                        "launcher)", key, given, key, have)


def install_compat() -> None:
    dist.init_process_group = tolerant_init_process_group
    dist.distributed_c10d.init_process_group = tolerant_init_process_group


def shutdown() -> None:
    """Destroy the process group, except in a child the rank forked (which
    runs the rank's atexit hooks too): its copy of the group has none of the
    parent's threads, and destroying it waits for them forever."""
    if dist.is_initialized() and os.getpid() == _group_pid:
        try:
            dist.destroy_process_group()
        except Exception as exc:  # noqa: BLE001 - exiting anyway; say why
            log.warning("destroying the process group failed: %s", exc)
