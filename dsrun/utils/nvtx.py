"""``deepspeed.utils.instrument_w_nvtx``: a decorator that marks each call of
a function as an NVTX range named after its ``__qualname__`` (seen in
Nsight Systems), as DeepSpeed's does.

Where NVTX cannot be used - no CUDA (a CPU-only torch has no NVTX), or
while ``torch.compile`` traces (a range push would break the graph) - the
wrapper only calls the function and returns its result. The range is
popped also when the function raises, so ranges stay balanced.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Optional, TypeVar

import torch

__all__ = ["instrument_w_nvtx"]

F = TypeVar("F", bound=Callable[..., Any])
_USABLE: Optional[bool] = None


def nvtx_usable() -> bool:
    """CUDA (and so NVTX) is available; decided once, at the first call."""
    global _USABLE
    if _USABLE is None:
        _USABLE = torch.cuda.is_available()
    return _USABLE


def instrument_w_nvtx(func: F) -> F:
    """Wrap ``func`` in an NVTX range per call (module docstring)."""
    name = func.__qualname__

    @functools.wraps(func)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        if not nvtx_usable() or torch.compiler.is_compiling():
            return func(*args, **kwargs)
        torch.cuda.nvtx.range_push(name)
        try:
            return func(*args, **kwargs)
        finally:
            torch.cuda.nvtx.range_pop()

    return wrapped  # type: ignore[return-value]
