"""Backend registry: launcher names -> backend classes (no if/elif chains)."""

from __future__ import annotations

import importlib

from dsrun.errors import DsrunUsageError
from dsrun.launcher.backends.base import Backend
from dsrun.launcher.spec import launcher_name

# name -> "module:Class"; modules load on first use so the SSH backend's
# paramiko import costs nothing for local jobs.
_REGISTRY = {
    "local": "dsrun.launcher.backends.local:LocalBackend",
    "openmpi": "dsrun.launcher.backends.openmpi:OpenMpiBackend",
    "slurm": "dsrun.launcher.backends.slurm:SlurmBackend",
    "ssh": "dsrun.launcher.backends.ssh:SshBackend",
}


def names() -> list[str]:
    return sorted(_REGISTRY)


def get_backend(name: str, **kwargs: object) -> Backend:
    target = _REGISTRY.get(launcher_name(name) or name)
    if target is None:
        raise DsrunUsageError(f"unknown launcher {name!r}; choose one of {', '.join(names())}")
    module, cls = target.split(":")
    return getattr(importlib.import_module(module), cls)(**kwargs)
