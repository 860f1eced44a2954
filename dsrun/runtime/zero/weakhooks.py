"""Gradient hooks that do not keep their ZeRO optimizer alive.

A hook registered on a parameter lives as long as the parameter, i.e. as
long as the user's module. A hook that held the optimizer strongly would
keep it, its flat buffers and optimizer state, and through
``optimizer.engine_step`` the engine, alive after the script dropped the
engine without ``destroy()`` (a notebook's second ``initialize()``). These
hooks hold it weakly (one dereference per gradient) and are removed when
the optimizer is collected.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch


def weak_grad_hook(method: Callable[[torch.Tensor], None]) -> Callable[[torch.Tensor], None]:
    """A post-accumulate-grad hook calling the bound ``method`` while its
    object lives (a no-op after)."""
    ref = weakref.WeakMethod(method)

    def hook(param: torch.Tensor) -> None:
        bound = ref()
        if bound is not None:
            bound(param)
    return hook


def remove_when_collected(owner: Any, handles: Iterable[Any]) -> None:
    """Remove ``handles`` (torch RemovableHandles) when ``owner`` is
    collected; removing them again later (close()) is harmless."""
    weakref.finalize(owner, _remove, list(handles)).atexit = False


def _remove(handles: list[Any]) -> None:
    for handle in handles:
        handle.remove()
