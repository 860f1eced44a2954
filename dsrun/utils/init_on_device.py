"""``deepspeed.OnDevice``: build modules with their tensors on a chosen
device and in a chosen floating dtype.

``with OnDevice(dtype=torch.bfloat16, device="meta"):`` makes every tensor
a torch factory creates inside the block (``torch.empty``, ``zeros``,
``randn``, ... and so every ``nn.Module``'s parameters and buffers) default
to ``device``, and every floating tensor created without an explicit dtype
default to ``dtype``. It uses torch's own mechanisms - a ``torch.device``
as context manager and ``torch.set_default_dtype`` - rather than
replacing torch functions as DeepSpeed's does, so it covers every factory.

Differences from DeepSpeed 0.19.8, both on purpose: an explicit
``device=`` or floating ``dtype=`` passed to a factory inside the block is
kept (DeepSpeed casts even an explicit ``dtype=torch.float32`` buffer to
``dtype``); and ``dtype`` must be a floating dtype (torch's default dtype
can only be one). ``enabled=False`` makes the block do nothing. The
previous default dtype is restored on exit, also after an exception. The
default dtype is process-wide: do not build models on other threads
meanwhile.
"""

from __future__ import annotations

from types import TracebackType
from typing import Optional, Union

import torch

__all__ = ["OnDevice"]


class OnDevice:
    """Context manager (module docstring)."""

    def __init__(self, dtype: torch.dtype, device: Union[str, torch.device] = "meta",
                 enabled: bool = True) -> None:
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise TypeError(f"OnDevice(dtype={dtype!r}): dtype must be a floating torch.dtype "
                            "(torch.float32, torch.float16, torch.bfloat16, ...)")
        self.dtype = dtype
        self.device = device
        self.enabled = enabled
        self._device_ctx: Optional[torch.device] = None
        self._saved_dtype: Optional[torch.dtype] = None

    def __enter__(self) -> OnDevice:
        if not self.enabled:
            return self
        if self._device_ctx is not None:
            raise RuntimeError("OnDevice is not re-entrant: use a new OnDevice(...) per block")
        self._saved_dtype = torch.get_default_dtype()
        self._device_ctx = torch.device(self.device)
        self._device_ctx.__enter__()
        torch.set_default_dtype(self.dtype)
        return self

    def __exit__(self, exc_type: Optional[type[BaseException]],
                 exc: Optional[BaseException], tb: Optional[TracebackType]) -> None:
        if not self.enabled or self._device_ctx is None:
            return
        assert self._saved_dtype is not None
        torch.set_default_dtype(self._saved_dtype)
        ctx, self._device_ctx = self._device_ctx, None
        ctx.__exit__(exc_type, exc, tb)
