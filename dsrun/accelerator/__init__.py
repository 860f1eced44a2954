"""``dsrun.accelerator``: what DeepSpeed scripts use as ``deepspeed.accelerator``.

``get_accelerator()`` returns one process-wide object describing the device
this rank trains on, so device-agnostic DeepSpeed code
(``get_accelerator().device_name(local_rank)``, ``.manual_seed(s)``,
``.synchronize()``, ``.communication_backend_name()``, ...) keeps working:

* :class:`CudaAccelerator` when the rank trains on a GPU, i.e. what
  :func:`dsrun.runtime.dist.compute_device` says once the process group is
  up (an NCCL group), and before that what
  :func:`dsrun.runtime.dist.default_backend` would pick (a GPU for this
  local rank, no ``dsrun --cpu``);
* :class:`CpuAccelerator` otherwise: CPU-only hosts, ``dsrun --cpu`` ranks
  on GPU hosts, gloo groups.

``DS_ACCELERATOR`` (DeepSpeed's override, read once, at the first call)
may say ``cpu`` or ``cuda``; ``cuda`` is refused where this rank does not
train on a GPU, and DeepSpeed's other accelerators (xpu, npu, mps, ...)
are not provided. :func:`set_accelerator` replaces the object.

Every answer comes from torch or the operating system at the time of the
call. CPU memory figures are the process's resident set (psutil; its peak
from the kernel's high-water mark where Linux keeps one), because the host
allocator hands memory back to the OS instead of caching it. DeepSpeed's
compiled ops are not part of dsrun: ``create_op_builder`` /
``get_op_builder`` raise; :mod:`dsrun.ops` has torch-backed optimizers.

The files carry DeepSpeed's names (``real_accelerator`` chooses,
``abstract_accelerator``, ``cpu_accelerator``, ``cuda_accelerator``), so
``from deepspeed.accelerator.real_accelerator import get_accelerator``
works too after ``import dsrun as deepspeed``.
"""

from __future__ import annotations

from dsrun.accelerator.abstract_accelerator import Accelerator, DeepSpeedAccelerator
from dsrun.accelerator.cpu_accelerator import CPU_Accelerator, CpuAccelerator, HostEvent
from dsrun.accelerator.cuda_accelerator import CUDA_Accelerator, CudaAccelerator
from dsrun.accelerator.real_accelerator import (
    OVERRIDE_VARIABLE,
    SUPPORTED_ACCELERATORS,
    get_accelerator,
    is_current_accelerator_supported,
    set_accelerator,
)

__all__ = [
    "OVERRIDE_VARIABLE", "SUPPORTED_ACCELERATORS", "Accelerator", "CPU_Accelerator",
    "CUDA_Accelerator", "CpuAccelerator", "CudaAccelerator", "DeepSpeedAccelerator",
    "HostEvent", "get_accelerator", "is_current_accelerator_supported", "set_accelerator",
]
