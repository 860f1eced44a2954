"""``deepspeed.utils.logger`` and ``log_dist`` for dsrun.

:data:`logger` is the logger dsrun's runtime writes to (``dsrun.runtime``;
its children, such as ``dsrun.runtime.checkpoint``, inherit its level), so
``logger.setLevel(logging.WARNING)`` quiets dsrun as it quiets DeepSpeed.
Importing this module gives it dsrun's default stdout handler
(:func:`dsrun.runtime.progress.ensure_visible`): like DeepSpeed's logger,
it is seen without configuring logging, and not twice once the application
configures its own.

:func:`log_dist` filters by rank as DeepSpeed 0.19.8's does: without a
process group the one process logs; with one, only the ranks listed in
``ranks`` log, every rank when ``ranks`` contains -1, and *no* rank when
``ranks`` is None or empty (DeepSpeed's rule, which its docstring leaves
implicit). The message is prefixed ``[Rank N]`` (N = the global rank; 0
without a process group, where DeepSpeed writes -1). Importing this module
does not import torch.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterable
from typing import Optional

from dsrun.runtime.progress import LOGGER_NAME, ensure_visible

logger = logging.getLogger(LOGGER_NAME)
ensure_visible()

__all__ = ["get_dist_msg", "log_dist", "logger"]


def _rank() -> Optional[int]:
    """The global rank, or None without a process group (torch not even
    imported: there is none)."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return None
    return dist.get_rank()


def get_dist_msg(message: str, ranks: Optional[Iterable[int]] = None) -> Optional[str]:
    """``message`` with its rank prefix when this rank should log it (module
    docstring), else None."""
    rank = _rank()
    wanted = list(ranks or ())
    if rank is not None and -1 not in wanted and rank not in wanted:
        return None
    return f"[Rank {0 if rank is None else rank}] {message}"


def log_dist(message: str, ranks: Optional[Iterable[int]] = None,
             level: int = logging.INFO) -> None:
    """Log ``message`` at ``level`` on the ranks DeepSpeed's ``log_dist`` would."""
    text = get_dist_msg(message, ranks)
    if text is not None:
        logger.log(level, text)
