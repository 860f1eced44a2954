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
    host has GPUs at all). A device named twice leaves none at all, as in
    CUDA and torch (``torch.cuda._parse_visible_devices``: "Repeated ordinal
    results in empty set"), so ``0,0`` is no GPU, not two ranks on GPU 0."""
    ids, twice = _scan_cvd(value, physical)
    return () if twice is not None else ids


def repeated_device(value: str, physical: int) -> DeviceId | None:
    """The first device CUDA_VISIBLE_DEVICES ``value`` names twice before
    its cut, or None."""
    return _scan_cvd(value, physical)[1]


def _scan_cvd(value: str, physical: int) -> tuple[tuple[DeviceId, ...], DeviceId | None]:
    """(the valid entries before the cut, the first of them named twice)."""
    ids: list[DeviceId] = []
    for part in value.split(","):
        part = part.strip()
        if re.fullmatch(r"\d+", part) and int(part) < max(physical, 0):
            device: DeviceId = int(part)
        elif _UUID.fullmatch(part) and physical > 0:
            device = part
        else:
            break
        if device in ids:
            return tuple(ids), device
        ids.append(device)
    return tuple(ids), None


def visible_devices_problem(environ: Mapping[str, str] | None = None) -> str | None:
    """Why this host's CUDA_VISIBLE_DEVICES hides every GPU by mistake (a
    device named twice), or None; hiding them on purpose (``''``, ``-1``)
    is no problem."""
    env = os.environ if environ is None else environ
    value = env.get("CUDA_VISIBLE_DEVICES")
    if value is None or env.get("DSRUN_FAKE_GPUS") is not None:
        return None
    twice = repeated_device(value, _physical_count())
    if twice is None:
        return None
    return (f"CUDA_VISIBLE_DEVICES={value!r} names device {twice} twice, and CUDA (and torch) "
            f"then see no GPU at all: list each device once, or set CUDA_VISIBLE_DEVICES='' "
            f"(or pass --cpu) for CPU ranks")


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
