"""Asynchronous saves: the training loop waits for almost nothing.

:meth:`AsyncSaver.start` (in the caller's thread) copies only the
*volatile* chunks (buffers, which forward may change) into a host buffer
and returns. A background thread then **stages** the rest - copies every
other chunk into the same host buffer (pinned on CUDA, on a side stream
after the work already queued) - and then writes this rank's files and, on
rank 0, commits (waiting for the other ranks' records on the file system:
no collective runs in the thread; gloo and NCCL groups are not safe to use
from two threads, and the training loop owns them). A rank whose part
fails posts its error on the save's :class:`~.coord.SaveBoard` (a key in
the c10d store, which needs no disk space): rank 0's committer and the
other ranks' writers see it within a poll and stop, rank 0 removes
``TAG.tmp/`` once no rank writes there any more, and every rank's error
is that first failure, its cause and file first. Rank 0's thread ends by
posting the save's outcome (committed, or its error once ``TAG.tmp/`` is
gone - or the path it could not remove), and the other ranks' threads end
only when they have it: every rank holds rank 0's verdict, and no rank
can exit (when the launcher stops the others) while rank 0 still has
``TAG.tmp/`` to clear. Staged chunks are the masters,
parameters and optimizer state, which only the optimizer step changes:
``engine.step()`` calls :meth:`AsyncSaver.wait_staged` before it updates
anything, so a step overlaps the staging with its forward and backward and
waits only for what is left. (Changing parameters in place by other means
while a save is staging - ``GatheredParameters(modifier_rank=...)``, manual
edits - must wait for :meth:`wait_staged` too.) The host buffer is kept for
the next save of the same size or smaller.

At most one save is in flight: :meth:`AsyncSaver.wait` (called by the next
save or load, by ``engine.wait_for_checkpoint()`` and ``engine.destroy()``,
and at interpreter exit) joins it and returns its error, which the caller
raises. At exit an error nobody collected is printed (one
``dsrun: error:`` line) and the process exits with status 1: a failed save
is never lost. The launcher stops every rank once one exits non-zero, so a
rank that exits with the error first waits until every rank has reported
it - printed it at exit, or had it raised in its script (the board's
``reported`` keys: :mod:`.coord`) - one deadline for all of them, at most
:data:`EXIT_WAIT_S` (or ``checkpoint.timeout`` when shorter). A rank still
running its script past that, or one that died, is not waited for: the
launcher then stops it. A rank that gets rank 0's failed verdict removes a
``TAG.tmp/`` it finds still there: a rank that gave up waiting on it wrote
it again after rank 0 had removed it (a writer checks the board before it
creates the directory, so only a rank between that check and rank 0's
failure can).
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
import threading
import time
from dataclasses import replace
from typing import Any, Callable, Optional

import torch

from dsrun.errors import CheckpointError
from dsrun.runtime.checkpoint.coord import OUTCOME, Failure, SaveBoard
from dsrun.runtime.checkpoint.storage import remove_tree
from dsrun.runtime.checkpoint.writer import (
    Commit,
    Planned,
    RankFailed,
    RankWrite,
    RecordsTimedOut,
    describe_failure,
)

log = logging.getLogger("dsrun.runtime.checkpoint")
# Savers with a save in flight or an error nobody collected yet: held here
# (not only by their engine, which a script may drop) until exit checks them.
_PENDING: set[AsyncSaver] = set()
# the longest a rank exiting with a save's error waits for the others to report it
EXIT_WAIT_S = 60.0


class AsyncSaver:
    """One background save at a time (module docstring)."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._thread: Optional[threading.Thread] = None
        self._staged = threading.Event()
        self._staged.set()
        self._error: Optional[str] = None
        self._tag: Optional[str] = None
        self._buffer: Optional[torch.Tensor] = None
        # the last save's board, this rank and TAG.tmp/ (the outcome and exit handshakes)
        self._board: Optional[SaveBoard] = None
        self._rank = 0
        self._tmp_dir = ""
        self.stage_wait_s = 0.0  # how long training waited in wait_staged, in all
        # time.perf_counter() when the last save's thread finished: on rank 0
        # once the tag is committed (or the failure cleared) and the outcome
        # posted, on the others once they hold it; None before, and while it runs
        self.finished_at: Optional[float] = None

    @property
    def in_flight(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _host_buffer(self, size: int, cuda: bool) -> torch.Tensor:
        if self._buffer is None or self._buffer.numel() < size:
            self._buffer = None  # free the old one first
            self._buffer = torch.empty(size, dtype=torch.uint8,
                                       pin_memory=cuda and torch.cuda.is_available())
        return self._buffer

    def start(self, write: RankWrite, commit: Optional[Commit], tag: str,
              board: Optional[SaveBoard] = None) -> None:
        """Copy the volatile chunks, then stage, write and commit in a thread;
        failures go on ``board`` (module docstring)."""
        assert not self.in_flight, "wait() before starting another save"
        if self._board is not None and self._rank == 0:
            # every rank agreed on this save: none reads the last one's keys any more
            self._board.clear()
        plan = write.plan
        cuda = any(c.tensor.is_cuda for c in plan.chunks)
        buffer = self._host_buffer(plan.bytes, cuda)
        chunks = [replace(c, tensor=buffer.narrow(0, c.offset, _nbytes(c))) for c in plan.chunks]
        sources = [c.tensor for c in plan.chunks]
        _copy([(h, s) for h, s, c in zip(chunks, sources, plan.chunks) if c.volatile], cuda)
        rest = [(h, s) for h, s, c in zip(chunks, sources, plan.chunks) if not c.volatile]
        ready = None
        if cuda:
            ready = torch.cuda.Event()
            ready.record()
        write.plan = replace(plan, chunks=chunks)
        write.board = board
        self._tag, self._error = tag, None
        self._board, self._rank, self._tmp_dir = board, write.rank, write.tmp_dir
        self._staged.clear()
        self.finished_at = None
        self._thread = threading.Thread(target=self._run, args=(rest, ready, write, commit),
                                        name=f"dsrun-checkpoint-{tag}", daemon=False)
        _PENDING.add(self)
        self._thread.start()

    def _run(self, rest: list[tuple[Planned, torch.Tensor]], ready: Any, write: RankWrite,
             commit: Optional[Commit]) -> None:
        try:
            failure = _attempt(write.rank, lambda: self._stage(rest, ready, write))
            self._write_and_commit(write, commit, failure)
        except BaseException as exc:  # noqa: BLE001 - never lost: wait() raises it
            self._error = self._error or (f"{type(exc).__name__}: {exc} (the asynchronous "
                                          f"save of tag {self._tag!r} failed)")
        try:
            if write.board is not None:
                self._settle(write.board, commit is not None)
        finally:
            self.finished_at = time.perf_counter()
        if self._error is None:
            _PENDING.discard(self)

    def _settle(self, board: SaveBoard, committer: bool) -> None:
        """Rank 0: post the outcome. The others: take it as their error
        (rank 0 has the whole picture), waiting at most ``timeout_s``; without
        it, their own error says where ``TAG.tmp/`` may be left."""
        if committer:
            board.post_key(OUTCOME, {"error": self._error})
            return
        found, outcome = board.wait_key(OUTCOME, self.timeout_s)
        if found:
            self._error = outcome["error"] or self._error
            if outcome["error"] and os.path.isdir(self._tmp_dir):
                remove_tree(self._tmp_dir)  # written again after rank 0 removed it
                if os.path.isdir(self._tmp_dir) and self._tmp_dir not in self._error:
                    self._error += f"; {self._tmp_dir} could not be removed: remove it by hand"
        elif self._error is not None:
            self._error += (f"; rank 0 did not report removing {self._tmp_dir}, which may "
                            f"be left behind (the next save of tag {self._tag!r}, or any "
                            "save once checkpoint.timeout has passed, removes it)")

    def _stage(self, rest: list[tuple[Planned, torch.Tensor]], ready: Any,
               write: RankWrite) -> None:
        try:
            if write.pause:
                write.pause.reached(write.rank, "stage", write.tag)
            _copy(rest, ready is not None, ready)
        finally:
            self._staged.set()

    def _write_and_commit(self, write: RankWrite, commit: Optional[Commit],
                          failure: Optional[Failure]) -> None:
        failure = failure or _attempt(write.rank, write.run)
        writers_left = True  # rank 0 waits for them to stop before removing TAG.tmp/
        if failure is not None:
            write.fail(failure)
        elif commit is not None:
            try:
                failure = _attempt(0, lambda: commit.wait_for_records(self.timeout_s,
                                                                      board=write.board),
                                   "committing: ")
            except RecordsTimedOut as exc:  # the ranks missing are silent: none to wait for
                failure, writers_left = Failure(0, f"committing: {exc}"), False
                write.fail(failure)  # a straggler then does not create TAG.tmp/ again
            if failure is None:
                failure = _attempt(0, commit.run, "committing: ")
                if failure is not None:  # every record was in before: no writer is left
                    writers_left = False
                    write.fail(failure)
        if failure is None:
            if commit is not None:
                log.info("saved checkpoint %s (asynchronously)",
                         os.path.join(commit.save_dir, commit.tag))
            return
        if commit is not None:  # rank 0 clears TAG.tmp/
            if writers_left:
                commit.wait_for_records(self.timeout_s, others_only=True, board=write.board,
                                        settle=True)
            remove_tree(commit.tmp_dir)
        left = (f"; {commit.tmp_dir} could not be removed: remove it by hand"
                if commit is not None and os.path.isdir(commit.tmp_dir) else "")
        self._error = (f"{failure.message} (the asynchronous save of tag {self._tag!r} "
                       f"failed on rank {failure.rank}){left}")

    def wait_staged(self) -> None:
        """Block until the save in flight no longer reads the live tensors."""
        if not self._staged.is_set():
            start = time.perf_counter()
            self._staged.wait()
            self.stage_wait_s += time.perf_counter() - start

    def pending(self) -> bool:
        """A save was started and not waited for (running or finished)."""
        return self._thread is not None

    def wait(self) -> Optional[str]:
        """Join the save in flight; its error (once), or None. The caller
        raises it: this rank has reported it (module docstring)."""
        error = self.join()
        if error is not None and self._board is not None:
            self._board.report()
        return error

    def join(self) -> Optional[str]:
        """:meth:`wait`, for the exit handler, which reports the error itself."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        error, self._error = self._error, None
        _PENDING.discard(self)
        return error

    def wait_for_reports(self, deadline: float) -> None:
        """At exit, once this rank printed the save's error: report it, then
        wait until every rank has, at most until ``deadline`` (monotonic)."""
        if self._board is not None:
            self._board.report()
            self._board.wait_for_reports(deadline - time.monotonic())


def _attempt(rank: int, run: Callable[[], None], what: str = "") -> Optional[Failure]:
    """Run one step of the save: None, or the failure to report - another
    rank's when it made this one stop (:class:`RankFailed`)."""
    try:
        run()
    except RankFailed as exc:
        return exc.failure
    except RecordsTimedOut:
        raise  # the caller removes TAG.tmp/ at once (AsyncSaver._write_and_commit)
    except CheckpointError as exc:
        return Failure(rank, f"{what}{exc}")
    except Exception as exc:  # noqa: BLE001 - reported to every rank, then raised
        return Failure(rank, f"{what}{describe_failure(exc)}")
    return None


def _nbytes(chunk: Planned) -> int:
    return chunk.tensor.numel() * chunk.tensor.element_size()


def _copy(pairs: list[tuple[Planned, torch.Tensor]], cuda: bool, ready: Any = None) -> None:
    """Copy each source tensor's bytes into its host chunk. On CUDA from a
    background thread (``ready`` given): on a side stream of the tensors'
    device (a thread's current device is not the caller's), after ``ready``,
    then synchronised."""
    device = next((s.device for _, s in pairs if s.is_cuda), None)
    if device is None or ready is None:
        for host, source in pairs:
            if host.tensor.numel():
                host.tensor.copy_(source.detach().reshape(-1).view(torch.uint8),
                                  non_blocking=cuda)
        if cuda:
            torch.cuda.synchronize()
        return
    with torch.cuda.device(device):
        stream = torch.cuda.Stream()
        stream.wait_event(ready)
        with torch.cuda.stream(stream):
            for host, source in pairs:
                if host.tensor.numel():
                    host.tensor.copy_(source.detach().reshape(-1).view(torch.uint8),
                                      non_blocking=True)
        stream.synchronize()


@atexit.register
def _wait_at_exit() -> None:
    """Join saves still in flight; an error nobody collected is printed, once
    every rank that has it has too (module docstring), and ends the process
    with status 1, so a failed save is not lost."""
    savers = list(_PENDING)
    failed = [(saver, error) for saver in savers if (error := saver.join())]
    if not failed:
        return
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    sys.stderr.write("".join(f"dsrun: error: {error}\n" for _, error in failed))
    sys.stderr.flush()
    deadline = time.monotonic() + min([EXIT_WAIT_S] + [saver.timeout_s for saver, _ in failed])
    for saver, _ in failed:
        saver.wait_for_reports(deadline)
    logging.shutdown()
    os._exit(1)
