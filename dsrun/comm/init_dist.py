"""``deepspeed.init_distributed`` (also ``deepspeed.comm.init_distributed``)
with DeepSpeed 0.19.8's signature: its parameters, in its positional order,
and nothing else, so a misspelt keyword is Python's ``TypeError`` naming it.

The process group itself is :func:`dsrun.runtime.dist.init_distributed`'s
business (where the rank and the master come from, keeping an existing
group, ``DEEPSPEED_TIMEOUT``); this layer maps DeepSpeed's arguments onto
it and turns on the communication logger from ``config``'s
``comms_logger`` section first, as DeepSpeed does.
"""

from __future__ import annotations

import datetime
from typing import Any, Optional

import torch.distributed as dist

from dsrun.comm.log import configure
from dsrun.errors import DsrunError
from dsrun.runtime import dist as runtime_dist
from dsrun.runtime.env import DistEnv

__all__ = ["init_distributed"]


def init_distributed(dist_backend: Optional[str] = None, auto_mpi_discovery: bool = True,
                     distributed_port: Optional[int] = None, verbose: bool = True,
                     timeout: Optional[datetime.timedelta] = None,
                     init_method: Optional[str] = None,
                     dist_init_required: Optional[bool] = None, config: Any = None,
                     rank: int = -1, world_size: int = -1, *,
                     backend: Optional[str] = None, env: Optional[DistEnv] = None) -> None:
    """Initialise the default process group unless one exists (then keep
    it, setting only ``timeout`` on it when given).

    DeepSpeed's parameters, in its order: ``dist_backend`` (default: NCCL
    on GPU ranks, gloo otherwise), ``distributed_port`` (the master's port
    when it is found through MPI or Slurm; by default a free one, or one
    derived from the Slurm job, where DeepSpeed uses 29500), ``timeout``
    (a ``datetime.timedelta``; by default ``DEEPSPEED_TIMEOUT``'s, else
    torch's), ``init_method``, ``rank`` and ``world_size`` (for an
    ``init_method`` such as ``tcp://``), ``config`` (a ``DeepSpeedConfig``,
    a resolved dsrun config or a config dict: its ``comms_logger`` section
    turns the communication logger on, as :func:`dsrun.comm.configure`
    does) and ``dist_init_required`` (False: a process group must exist
    already, as DeepSpeed requires). ``auto_mpi_discovery`` and ``verbose``
    have no effect: dsrun always reads MPI's and Slurm's variables when its
    own and torchrun's are absent. dsrun's own keywords: ``backend`` (the
    same as ``dist_backend``) and ``env`` (the :class:`DistEnv` to use
    instead of reading the environment).
    """
    if backend is not None and dist_backend is not None and backend != dist_backend:
        raise TypeError(f"init_distributed: dist_backend={dist_backend!r} and "
                        f"backend={backend!r} name different backends; give one")
    if timeout is not None and not isinstance(timeout, datetime.timedelta):
        raise TypeError(f"init_distributed(timeout={timeout!r}): the timeout is a "
                        f"datetime.timedelta, got {type(timeout).__name__}")
    configure(deepspeed_config=config)
    if dist_init_required is False and not (dist.is_available() and dist.is_initialized()):
        raise DsrunError("init_distributed(dist_init_required=False) needs a process group "
                         "that exists already, and there is none: leave dist_init_required "
                         "out (or True) to create it, or start the script with dsrun")
    compat = {"distributed_port": distributed_port, "init_method": init_method,
              "rank": rank, "world_size": world_size}
    runtime_dist.init_distributed(backend or dist_backend, timeout=timeout, env=env,
                                  **{key: value for key, value in compat.items()
                                     if value is not None})
