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

The "once" variants remember what they were called with, per process, as
DeepSpeed's: :func:`warning_once` (also ``logger.warning_once``) warns once
per distinct arguments, :func:`log_dist_once` (also
``logger.log_dist_once``) logs once per distinct message, ranks and level.
The arguments must be hashable (a ``ranks`` list is turned into a tuple).
"""

from __future__ import annotations

import functools
import json
import logging
import os
import sys
from collections.abc import Iterable
from typing import Any, Optional

from dsrun.runtime.progress import LOGGER_NAME, ensure_visible

logger = logging.getLogger(LOGGER_NAME)
ensure_visible()

__all__ = ["LoggerFactory", "get_current_level", "get_dist_msg", "get_log_level_from_string",
           "log_dist", "log_dist_once", "log_levels", "logger", "print_configuration",
           "print_dist", "print_json_dist", "set_log_level_from_string", "should_log_le",
           "warning_once"]

log_levels = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING,
              "error": logging.ERROR, "critical": logging.CRITICAL}
_FACTORY_MARK = "_dsrun_logger_factory"


def _rank() -> Optional[int]:
    """The global rank, or None without a process group (torch not even
    imported: there is none)."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return None
    return dist.get_rank()


def _logging_rank(ranks: Optional[Iterable[int]]) -> Optional[int]:
    """The rank to name when this rank should log for ``ranks`` (module
    docstring), else None."""
    rank = _rank()
    wanted = list(ranks or ())
    if rank is not None and -1 not in wanted and rank not in wanted:
        return None
    return 0 if rank is None else rank


def get_dist_msg(message: str, ranks: Optional[Iterable[int]] = None) -> Optional[str]:
    """``message`` with its rank prefix when this rank should log it (module
    docstring), else None."""
    rank = _logging_rank(ranks)
    return None if rank is None else f"[Rank {rank}] {message}"


def log_dist(message: str, ranks: Optional[Iterable[int]] = None,
             level: int = logging.INFO) -> None:
    """Log ``message`` at ``level`` on the ranks DeepSpeed's ``log_dist`` would."""
    text = get_dist_msg(message, ranks)
    if text is not None:
        logger.log(level, text)


def print_dist(message: str, ranks: Optional[Iterable[int]] = None) -> None:
    """Print ``message`` (with its rank prefix) to stdout on the ranks
    :func:`log_dist` would log on, whatever the log level."""
    text = get_dist_msg(message, ranks)
    if text is not None:
        print(text, flush=True)


@functools.cache
def _log_dist_once(message: str, ranks: Optional[tuple[int, ...]], level: int) -> None:
    log_dist(message, ranks=ranks, level=level)


def log_dist_once(message: str, ranks: Optional[Iterable[int]] = None,
                  level: int = logging.INFO) -> None:
    """:func:`log_dist`, once per process for each message, ranks and level."""
    _log_dist_once(message, None if ranks is None else tuple(ranks), level)


@functools.cache
def warning_once(*args: Any, **kwargs: Any) -> None:
    """``logger.warning(*args, **kwargs)``, once per process for the same
    arguments (whoever calls: the message is the key)."""
    kwargs.setdefault("stacklevel", 2)  # the caller's line, not this one
    logger.warning(*args, **kwargs)


# DeepSpeed attaches both to its logger: ``logger.warning_once("...")``.
logger.warning_once = warning_once  # type: ignore[attr-defined]
logger.log_dist_once = log_dist_once  # type: ignore[attr-defined]


def print_configuration(args: Any, name: str) -> None:
    """Log ``name:`` then each attribute of ``args`` (an ``argparse.Namespace``
    or any object with ``vars()``), sorted, one per line at INFO, as
    DeepSpeed's: ``  lr ........................... 0.001``."""
    logger.info("%s:", name)
    for key in sorted(vars(args)):
        logger.info("  %s %s %s", key, "." * (29 - len(key)), getattr(args, key))


def print_json_dist(message: dict[str, Any], ranks: Optional[Iterable[int]] = None,
                    path: Optional[str] = None) -> None:
    """On the ranks :func:`log_dist` would log on: set ``message["rank"]`` and
    write ``message`` as JSON to ``path`` (synced to disk)."""
    rank = _logging_rank(ranks)
    if rank is None:
        return
    if path is None:
        raise ValueError("print_json_dist needs path= (the JSON file to write)")
    message["rank"] = rank
    with open(path, "w", encoding="utf-8") as out:
        json.dump(message, out)
        out.flush()
        os.fsync(out.fileno())


def get_log_level_from_string(log_level_str: str) -> int:
    """``"info"`` -> ``logging.INFO`` (any case); ValueError naming the valid ones."""
    level = log_levels.get(log_level_str.lower())
    if level is None:
        raise ValueError(f"log level {log_level_str!r} is not one of {sorted(log_levels)}")
    return level


def set_log_level_from_string(log_level_str: str,
                              custom_logger: Optional[logging.Logger] = None) -> None:
    """Set ``custom_logger`` (default: dsrun's :data:`logger`) and its handlers
    to the named level."""
    level = get_log_level_from_string(log_level_str)
    target = logger if custom_logger is None else custom_logger
    target.setLevel(level)
    for handler in target.handlers:
        handler.setLevel(level)


def get_current_level() -> int:
    """The effective level of dsrun's :data:`logger`."""
    return logger.getEffectiveLevel()


def should_log_le(max_log_level_str: str) -> bool:
    """True when dsrun's logger logs at ``max_log_level_str`` or below
    (``should_log_le("info")``: the level is INFO or DEBUG)."""
    if not isinstance(max_log_level_str, str):
        raise ValueError(f"should_log_le wants a level name, got {max_log_level_str!r}")
    return get_current_level() <= get_log_level_from_string(max_log_level_str)


class LoggerFactory:
    """DeepSpeed's logger factory (module docstring)."""

    @staticmethod
    def create_logger(name: Optional[str] = None, level: int = logging.WARNING
                      ) -> logging.Logger:
        """The logger ``name`` at ``level``, not propagating, with one stdout
        handler formatted ``[time] [LEVEL] [file:line:function] message``."""
        if name is None:
            raise ValueError("LoggerFactory.create_logger needs a name")
        made = logging.getLogger(name)
        made.setLevel(level)
        made.propagate = False
        ours = [h for h in made.handlers if getattr(h, _FACTORY_MARK, False)]
        handler = ours[0] if ours else logging.StreamHandler(stream=sys.stdout)
        handler.setLevel(level)
        if not ours:
            handler.setFormatter(logging.Formatter(
                "[%(asctime)s] [%(levelname)s] [%(filename)s:%(lineno)d:%(funcName)s] "
                "%(message)s"))
            setattr(handler, _FACTORY_MARK, True)
            made.addHandler(handler)
        return made
