"""Choosing the process-wide accelerator (:mod:`dsrun.accelerator` says how)."""

from __future__ import annotations

import os
import threading
from typing import Optional

import torch
import torch.distributed as dist

from dsrun.accelerator.abstract_accelerator import Accelerator
from dsrun.accelerator.cpu_accelerator import CpuAccelerator
from dsrun.accelerator.cuda_accelerator import CudaAccelerator
from dsrun.errors import DsrunError
from dsrun.runtime import dist as rank_dist
from dsrun.runtime.env import DistEnv

#: Accelerators dsrun provides, by DeepSpeed's names.
SUPPORTED_ACCELERATORS = ("cuda", "cpu")
#: DeepSpeed's variable that overrides the detected accelerator.
OVERRIDE_VARIABLE = "DS_ACCELERATOR"

_ACCELERATORS: dict[str, type[Accelerator]] = {"cuda": CudaAccelerator, "cpu": CpuAccelerator}
_current: Optional[Accelerator] = None
_lock = threading.Lock()


def choose(override: Optional[str], rank_device: str, cuda_available: bool) -> str:
    """The accelerator's name (pure): ``override`` (``DS_ACCELERATOR``) when
    set and possible, else the type of the device the rank trains on."""
    if not override:
        return "cuda" if rank_device == "cuda" else "cpu"
    name = override.strip().lower()
    if name not in _ACCELERATORS:
        raise DsrunError(f"{OVERRIDE_VARIABLE}={override!r}: dsrun provides the "
                         f"{' and '.join(SUPPORTED_ACCELERATORS)} accelerators")
    if name == "cuda" and not cuda_available:
        raise DsrunError(f"{OVERRIDE_VARIABLE}=cuda, but torch sees no CUDA device here")
    if name == "cuda" and rank_device != "cuda":
        raise DsrunError(f"{OVERRIDE_VARIABLE}=cuda, but this rank trains on the CPU "
                         "(started with dsrun --cpu, or its process group is not NCCL)")
    return name


def rank_device_type() -> str:
    """``"cuda"`` or ``"cpu"``: the device this rank's process group trains
    on, or before there is one, the device dsrun's bootstrap would choose."""
    if dist.is_available() and dist.is_initialized():
        return rank_dist.compute_device().type
    env = DistEnv.detect(mpi_size=rank_dist._mpi_world_size)
    return "cuda" if rank_dist.uses_nccl(rank_dist.default_backend(env)) else "cpu"


def get_accelerator() -> Accelerator:
    """The process-wide accelerator, chosen at the first call
    (:mod:`dsrun.accelerator` says how)."""
    global _current
    with _lock:
        if _current is None:
            name = choose(os.environ.get(OVERRIDE_VARIABLE), rank_device_type(),
                          torch.cuda.is_available())
            _current = _ACCELERATORS[name]()
        return _current


def set_accelerator(accelerator: Accelerator) -> None:
    """Make ``accelerator`` the one :func:`get_accelerator` returns."""
    global _current
    if not isinstance(accelerator, Accelerator):
        raise TypeError(f"set_accelerator() takes a dsrun.accelerator.Accelerator "
                        f"(CudaAccelerator or CpuAccelerator), got {type(accelerator).__name__}")
    with _lock:
        _current = accelerator


def is_current_accelerator_supported() -> bool:
    """Whether the current accelerator is one dsrun provides (cuda or cpu)."""
    return get_accelerator().device_name() in SUPPORTED_ACCELERATORS
