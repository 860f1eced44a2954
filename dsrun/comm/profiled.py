"""How :mod:`dsrun.comm` runs an operation: straight through to
``torch.distributed``, or - when the communication logger
(:mod:`dsrun.runtime.commlog`) profiles it - blocking and timed, then filed
under its log name and message size.

The message size is the bytes of the input tensor (``nbytes``), the sum
over a list (``list_bytes``); :class:`TimedWork` times a point-to-point
operation until its handle completes; :class:`Done` is the handle of an
operation that completed inside the call.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any, Optional

import torch
import torch.distributed as dist

from dsrun.runtime.commlog import LOGGER


def nbytes(tensor: Optional[torch.Tensor]) -> int:
    return tensor.numel() * tensor.element_size() if isinstance(tensor, torch.Tensor) else 0


def list_bytes(tensors: Optional[Sequence[torch.Tensor]]) -> int:
    return sum(nbytes(t) for t in tensors or ())


def _sync(tensor: Optional[torch.Tensor]) -> None:
    if isinstance(tensor, torch.Tensor) and tensor.is_cuda:
        torch.cuda.synchronize(tensor.device)


def wait(result: Any) -> None:
    """Wait on a work handle, or on each of a list of them."""
    for work in result if isinstance(result, list) else [result]:
        if work is not None and hasattr(work, "wait"):
            work.wait()


class Done:
    """The handle of an operation that completed inside the call."""

    def wait(self, timeout: Any = None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


class TimedWork:
    """A point-to-point operation's work handle, timed until it completes:
    its entry is logged when the last handle of its call is waited on (or
    seen completed)."""

    def __init__(self, work: Any, finish: Callable[[], None]) -> None:
        self._work = work
        self._finish: Optional[Callable[[], None]] = finish

    def _done(self) -> None:
        finish, self._finish = self._finish, None
        if finish is not None:
            finish()

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        result = self._work.wait(*args, **kwargs)
        self._done()
        return result

    def is_completed(self) -> bool:
        completed = bool(self._work.is_completed())
        if completed:
            self._done()
        return completed

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)


def call(kind: str, log_name: str, prof: bool, group: Any, size: Callable[[], int],
         device_of: Optional[torch.Tensor], fn: Callable[..., Any], /, *args: Any,
         point_to_point: bool = False, **kwargs: Any) -> Any:
    """Run ``fn(*args, **kwargs)``; when the logger profiles ``log_name``,
    blocking and timed, filed as operation ``kind``. Asynchronous
    ``point_to_point`` operations are not waited for here (an ``isend``
    waiting for its ``irecv``, posted after it by both ranks, would never
    return): they are timed until their handles complete.

    Called by the public function itself (the logger's ``debug`` names the
    function two frames up from here)."""
    if not LOGGER.enabled or not LOGGER.wants(log_name, prof):
        return fn(*args, **kwargs)
    name = LOGGER.name_for(log_name)
    _sync(device_of)
    start = time.perf_counter()
    result = fn(*args, **kwargs)
    if point_to_point:
        works = result if isinstance(result, list) else [result]
        left = [len(works)]

        def finish() -> None:
            left[0] -= 1
            if left[0] == 0:
                _sync(device_of)
                LOGGER.append(kind, name, time.perf_counter() - start, size(),
                              dist.get_world_size(group))
        timed = [TimedWork(work, finish) for work in works]
        return timed if isinstance(result, list) else timed[0]
    wait(result)
    _sync(device_of)
    elapsed = time.perf_counter() - start
    LOGGER.append(kind, name, elapsed, size(), dist.get_world_size(group))
    return result
