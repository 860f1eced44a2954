"""Asynchronous saves: copy to host memory now, write in a background thread.

:meth:`AsyncSaver.start` copies every chunk this rank writes into one host
buffer (pinned on CUDA; kept for the next save of the same size or
smaller), so training may change the live tensors at once, and runs the
rank's write - and on rank 0 the commit, which waits for the other ranks'
records on the file system - in a background thread. At most one save is
in flight: :meth:`AsyncSaver.wait` (called by the next save or load, by
``engine.destroy()`` and at interpreter exit) joins it and returns its
error, which the caller raises. At exit an error that nobody collected is
logged and the process exits with status 1: a failed save is never lost.
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
import threading
from dataclasses import replace
from typing import Optional

import torch

from dsrun.runtime.checkpoint.storage import remove_tree
from dsrun.runtime.checkpoint.writer import Commit, RankPlan, RankWrite, _status

log = logging.getLogger("dsrun.runtime.checkpoint")
# Savers with a save in flight or an error nobody collected yet: held here
# (not only by their engine, which a script may drop) until exit checks them.
_PENDING: set[AsyncSaver] = set()


class AsyncSaver:
    """One background save at a time (module docstring)."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._thread: Optional[threading.Thread] = None
        self._error: Optional[str] = None
        self._tag: Optional[str] = None
        self._buffer: Optional[torch.Tensor] = None

    @property
    def in_flight(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def snapshot(self, plan: RankPlan) -> RankPlan:
        """``plan`` with every chunk copied into host memory."""
        cuda = any(c.tensor.is_cuda for c in plan.chunks)
        if self._buffer is None or self._buffer.numel() < plan.bytes:
            self._buffer = None  # free the old one first
            self._buffer = torch.empty(plan.bytes, dtype=torch.uint8,
                                       pin_memory=cuda and torch.cuda.is_available())
        chunks = []
        for chunk in plan.chunks:
            size = chunk.tensor.numel() * chunk.tensor.element_size()
            host = self._buffer.narrow(0, chunk.offset, size)
            if size:
                host.copy_(chunk.tensor.detach().reshape(-1).view(torch.uint8),
                           non_blocking=cuda)
            chunks.append(replace(chunk, tensor=host))
        if cuda:
            torch.cuda.synchronize()
        return replace(plan, chunks=chunks)

    def start(self, write: RankWrite, commit: Optional[Commit], tag: str) -> None:
        assert not self.in_flight, "wait() before starting another save"
        self._tag = tag
        self._error = None
        self._thread = threading.Thread(target=self._run, args=(write, commit),
                                        name=f"dsrun-checkpoint-{tag}", daemon=False)
        _PENDING.add(self)
        self._thread.start()

    def _run(self, write: RankWrite, commit: Optional[Commit]) -> None:
        try:
            self._write_and_commit(write, commit)
        except BaseException as exc:  # noqa: BLE001 - never lost: wait() raises it
            self._error = f"{type(exc).__name__}: {exc}"
        if self._error is None:
            _PENDING.discard(self)

    def _write_and_commit(self, write: RankWrite, commit: Optional[Commit]) -> None:
        status = _status(write.run)
        if status:
            write.fail(status)
            self._error = status
            if commit is not None:  # rank 0 clears TAG.tmp once the others stopped writing
                _status(lambda: commit.wait_for_records(self.timeout_s, others_only=True))
                remove_tree(commit.tmp_dir)
            return
        if commit is None:
            return
        status = _status(lambda: (commit.wait_for_records(self.timeout_s), commit.run()))
        if status:
            remove_tree(commit.tmp_dir)
            self._error = f"committing: {status}"
        else:
            log.info("saved checkpoint %s (asynchronously)",
                     os.path.join(commit.save_dir, commit.tag))

    def wait(self) -> Optional[str]:
        """Join the save in flight; its error (once), or None."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        error, self._error = self._error, None
        _PENDING.discard(self)
        if error:
            return f"the asynchronous save of tag {self._tag!r} failed: {error}"
        return None


@atexit.register
def _wait_at_exit() -> None:
    """Join saves still in flight; an error nobody collected ends the
    process with status 1 (after logging it), so a failed save is not lost."""
    errors = [e for e in (saver.wait() for saver in list(_PENDING)) if e]
    if not errors:
        return
    for error in errors:
        log.critical("%s", error)
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    sys.stderr.write("".join(f"dsrun: error: {e}\n" for e in errors))
    sys.stderr.flush()
    os._exit(1)
