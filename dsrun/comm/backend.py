"""``deepspeed.comm.backend``: DeepSpeed's ``Backend`` base class.

In DeepSpeed a backend object (``TorchBackend``, ``CCLBackend``) wraps
``torch.distributed`` behind ``deepspeed.comm``; dsrun's
:mod:`dsrun.comm.comm` calls ``torch.distributed`` itself and makes no
backend object. The base class is here for code that subclasses it or
checks ``isinstance`` against it, with DeepSpeed's attributes.
"""

from __future__ import annotations

from typing import Any

__all__ = ["Backend"]


class Backend:
    """A communication backend's name, world rank and size, and state."""

    def __init__(self, name: str = "backend", rank: int = 0, size: int = 1) -> None:
        self.name = name
        self.world_group: Any = None
        self.world_size = size
        self.world_rank = rank
        self.process_groups: list[Any] = []
        self.initialized = False

    def is_initialized(self) -> bool:
        return self.initialized

    def new_group(self) -> None:
        """Subclasses make a group here (DeepSpeed's base does nothing)."""

    def init_process_group(self) -> None:
        """Subclasses start the world group here; the base marks itself initialised."""
        self.initialized = True
