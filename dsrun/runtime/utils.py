"""DeepSpeed's ``deepspeed.runtime.utils`` helpers that training scripts call.

``see_memory_usage(message, force=False)``: with ``force=True``, global
rank 0 logs ``message`` and this process's memory (CUDA allocated and
reserved with their peaks where CUDA is in use, the host resident set and
its peak, the machine's memory in use); without it, nothing - as in
DeepSpeed, where scripts leave the calls in and switch them with ``force``.

``RepeatingLoader`` is :class:`dsrun.runtime.dataloader.RepeatingLoader`
(imported on first use: it needs torch).
"""

from __future__ import annotations

import logging
from typing import Any

from dsrun.runtime.progress import LOGGER_NAME, ensure_visible, memory_line

__all__ = ["RepeatingLoader", "see_memory_usage"]  # noqa: F822 - RepeatingLoader is lazy


def __getattr__(name: str) -> Any:
    if name == "RepeatingLoader":
        from dsrun.runtime.dataloader import RepeatingLoader
        return RepeatingLoader
    raise AttributeError(f"module 'dsrun.runtime.utils' has no attribute {name!r}")

log = logging.getLogger(LOGGER_NAME)


def see_memory_usage(message: str, force: bool = False) -> None:
    if not force:
        return
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_rank() != 0:
        return
    ensure_visible()
    log.info("%s | %s", message, memory_line())
