"""The inner optimizer's implementation and pieces for the ZeRO masters
(:mod:`~.masters`' module docstring says why): ``fused``/``foreach``
choice (:func:`inner_kwargs`), piece size (:func:`piece_size`) and the
pieces themselves (:func:`split_master`)."""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any, Optional

import torch

HOST_PIECE = 1 << 20  # elements per piece for non-fused steps in host memory (4 MiB fp32)
OFFLOAD_PIECE = 1 << 23  # elements per offloaded step-and-copy-back piece (32 MiB fp32)
# torch classes whose fused kernel is elementwise per tensor (a flat master
# steps bitwise like its parameters: measured; torch's fused SGD is not)
FUSED_CLASSES: tuple[type, ...] = (torch.optim.Adam, torch.optim.AdamW)


def fused_devices() -> tuple[str, ...]:
    """Device types torch has fused optimizer kernels for."""
    try:
        from torch.utils._foreach_utils import _get_fused_kernels_supported_devices
        return tuple(_get_fused_kernels_supported_devices())
    except ImportError:  # pragma: no cover - older torch
        return ("cuda",)


def inner_kwargs(optimizer_cls: type, kwargs: Mapping[str, Any], device: torch.device
                 ) -> dict[str, Any]:
    """``kwargs`` with the implementation the inner optimizer should use
    (module docstring): the client's ``fused``/``foreach`` when it set one,
    else ``fused=True`` for torch's Adam/AdamW on a device with fused
    kernels, else ``foreach=True`` where the class takes it."""
    out = dict(kwargs)
    if out.get("fused") or out.get("foreach") is not None:
        return out
    try:
        accepted = inspect.signature(optimizer_cls.__init__).parameters
    except (TypeError, ValueError):
        return out
    if optimizer_cls in FUSED_CLASSES and "fused" in accepted \
            and device.type in fused_devices() and not out.get("differentiable"):
        out["fused"] = True
        out.pop("foreach", None)
    elif "foreach" in accepted and not out.get("fused"):
        out["foreach"] = True
    return out


def piece_size(sub_group_size: Optional[int], kwargs: Mapping[str, Any],
               device: torch.device, offload: bool = False) -> Optional[int]:
    """Elements per inner-optimizer piece (None: whole masters): the
    client's ``sub_group_size``, else :data:`OFFLOAD_PIECE` under offload
    (each piece's copy back to the GPU overlaps the next piece's step), else
    :data:`HOST_PIECE` for a non-fused step in host memory (module docstring)."""
    if sub_group_size is not None:
        return sub_group_size
    if offload:
        return OFFLOAD_PIECE
    if device.type == "cpu" and not kwargs.get("fused"):
        return HOST_PIECE
    return None


def split_master(master: torch.nn.Parameter, size: Optional[int],
                 views: bool = False) -> list[torch.nn.Parameter]:
    """``master`` itself when ``size`` is None or it has at most ``size``
    elements (unless ``views``), else parameters that are views of
    consecutive pieces."""
    if size is not None and size < 1:
        raise ValueError(f"sub_group_size must be >= 1, got {size}")
    n = master.numel()
    if not views and (size is None or n <= size):
        return [master]
    size = size or max(n, 1)
    flat = master.detach()
    return [torch.nn.Parameter(flat.narrow(0, a, min(size, n - a))) for a in range(0, n, size)]
