"""Count this host's GPUs without importing torch.

The launcher and node agents must stay torch-free, so devices are found the
way the driver exposes them: ``CUDA_VISIBLE_DEVICES`` when the user set it,
else the NVIDIA driver's ``/proc`` entries, else ``nvidia-smi -L``.

A device is named as ``CUDA_VISIBLE_DEVICES`` names it: an index (``0``),
or a GPU or MIG UUID (``GPU-8f2c...``, ``MIG-GPU-8f2c.../1/0``,
``MIG-3b6e...``), as Slurm and Kubernetes set it. Ranks get the same names
back in their own ``CUDA_VISIBLE_DEVICES``, so a UUID list stays a UUID
list (an index there would mean another GPU).
``DSRUN_FAKE_GPUS=N`` overrides everything; it exists so that GPU layout
code paths can be tested on CPU machines and is documented as such.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Mapping
from typing import Union

#: A device as CUDA_VISIBLE_DEVICES names it: an index, or a GPU/MIG UUID.
DeviceId = Union[int, str]
_UUID = re.compile(r"(GPU|MIG)-[0-9A-Za-z][0-9A-Za-z/-]*")

_PROC_GPUS = "/proc/driver/nvidia/gpus"


def visible_devices(environ: Mapping[str, str] | None = None) -> tuple[DeviceId, ...]:
    """Device indices usable on this host (empty tuple on a CPU-only host)."""
    env = os.environ if environ is None else environ
    fake = env.get("DSRUN_FAKE_GPUS")
    if fake is not None:
        return tuple(range(int(fake)))
    physical = _physical_count()
    cvd = env.get("CUDA_VISIBLE_DEVICES")
    if cvd is not None:
        return _parse_cvd(cvd, physical)
    return tuple(range(physical))


def _parse_cvd(value: str, physical: int) -> tuple[DeviceId, ...]:
    """Devices from CUDA_VISIBLE_DEVICES, cut at the first invalid entry as
    CUDA does: indices below the physical count, and GPU/MIG UUIDs (when the
    host has GPUs at all)."""
    ids: list[DeviceId] = []
    for part in value.split(","):
        part = part.strip()
        if re.fullmatch(r"\d+", part) and int(part) < max(physical, 0):
            ids.append(int(part))
        elif _UUID.fullmatch(part) and physical > 0:
            ids.append(part)
        else:
            break
    return tuple(ids)


def _physical_count() -> int:
    try:
        return len(os.listdir(_PROC_GPUS))
    except OSError:
        pass
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return 0
    try:
        out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return 0
    return sum(1 for line in out.stdout.splitlines() if line.startswith("GPU "))


def usable_cpu_list() -> tuple[int, ...]:
    """The CPUs this process may run on, sorted (all of them off Linux)."""
    try:
        return tuple(sorted(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return tuple(range(os.cpu_count() or 1))


def usable_cpus() -> int:
    """CPUs this process may run on (affinity-aware)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1
