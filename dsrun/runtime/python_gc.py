"""``disable_python_gc`` (DeepSpeed's config key): automatic cyclic garbage
collection off while an engine that asked for it lives.

:func:`hold` collects once and disables the collector for the first engine
that asks; :func:`release` (from ``engine.destroy()``) turns it back on
when the last one is done, and only if it was on before. Collections the
script wants at safe points: ``engine.collect_python_gc()``. A forked child
starts with no holders and the collector as the parent had it before.
"""

from __future__ import annotations

import gc
import logging
import os
import threading

log = logging.getLogger(__name__)

_lock = threading.Lock()
_holders = 0
_restore = False


def hold() -> None:
    """Disable automatic collection (collecting once first); each call is
    undone by one :func:`release`."""
    global _holders, _restore
    with _lock:
        if _holders == 0:
            _restore = gc.isenabled()
            if _restore:
                collected = gc.collect()
                gc.disable()
                log.info("disable_python_gc: automatic cyclic GC off (collected %d objects "
                         "first); engine.collect_python_gc() collects on demand", collected)
        _holders += 1


def release() -> None:
    """Undo one :func:`hold`; the last one restores the collector."""
    global _holders, _restore
    with _lock:
        if _holders == 0:
            return
        _holders -= 1
        if _holders == 0 and _restore:
            _restore = False
            gc.enable()


def _after_fork_in_child() -> None:
    global _holders, _restore, _lock
    _lock = threading.Lock()
    if _holders and _restore:
        gc.enable()
    _holders, _restore = 0, False


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
