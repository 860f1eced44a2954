"""Rank 0's wait for the other ranks' records of an asynchronous save.

An asynchronous save (:mod:`.async_save`) runs no collective outside the
caller's thread, so rank 0's committer learns that the other ranks have
written their part from the shared file system: each rank's record
(``rank_RRRRR.json``) appears in ``TAG.tmp/`` when its part is complete.
A rank whose part fails says so on the save's :class:`~.coord.SaveBoard`
(else, with no store, in an error file next to its data), and a rank that
writes nothing for ``checkpoint.timeout`` is given up. Used through
:meth:`.writer.Commit.wait_for_records`.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Optional

from dsrun.errors import CheckpointError
from dsrun.runtime.checkpoint.coord import Failure, SaveBoard, first_failure
from dsrun.runtime.checkpoint.manifest import error_file, rank_file, record_file
from dsrun.runtime.checkpoint.storage import read_file

log = logging.getLogger("dsrun.runtime.checkpoint")

POLL_S = 0.05


class RankFailed(CheckpointError):
    """Another rank's part of an asynchronous save failed (``failure``)."""

    def __init__(self, failure: Failure) -> None:
        super().__init__(failure.message)
        self.failure = failure


class RecordsTimedOut(CheckpointError):
    """Rank 0's commit gave up on ranks that wrote nothing for the timeout."""


def wait_for_records(tmp_dir: str, world: int, timeout_s: float, others_only: bool = False,
                     board: Optional[SaveBoard] = None, settle: bool = False) -> None:
    """Wait until every rank's record is in ``tmp_dir`` (``others_only``:
    every rank but 0's); a rank's failure (on the ``board``, else in its
    error file) is raised at once as :class:`RankFailed`; ranks that write
    nothing for ``timeout_s``: :class:`RecordsTimedOut`. ``settle``: wait
    only until every rank has a record or a failure, raising nothing (then
    ``TAG.tmp/`` can go). The deadline moves while some rank's data file
    still grows."""
    deadline = time.monotonic() + timeout_s
    sizes: dict[int, int] = {}
    ranks = range(1 if others_only else 0, world)
    while True:
        posted = board.posted() if board is not None else {}
        failed = [posted.get(r) or _error_file(tmp_dir, r) for r in ranks]
        failed_ranks = {f.rank for f in failed if f is not None}
        first = first_failure(failed)
        if first is not None and not settle:
            raise RankFailed(first)
        missing = [r for r in ranks if r not in failed_ranks
                   and not os.path.exists(os.path.join(tmp_dir, record_file(r)))]
        if not missing:
            return
        grew = False
        for rank in missing:
            size = _size(os.path.join(tmp_dir, rank_file(rank)))
            grew |= size != sizes.get(rank)
            sizes[rank] = size
        if grew:
            deadline = time.monotonic() + timeout_s
        if time.monotonic() > deadline:
            if settle:
                log.warning("rank(s) %s still have not finished writing to %s; removing it",
                            ", ".join(map(str, missing)), tmp_dir)
                return
            raise RecordsTimedOut(
                f"rank(s) {', '.join(map(str, missing))} wrote nothing for {timeout_s:g} s "
                f"and left no record in {tmp_dir} (a rank died, or the directory is "
                "not on a file system every rank shares)")
        time.sleep(POLL_S)


def _error_file(tmp_dir: str, rank: int) -> Optional[Failure]:
    """A failure a rank could not post (no store): its error file."""
    path = os.path.join(tmp_dir, error_file(rank))
    if not os.path.exists(path):
        return None
    try:
        return Failure(rank, read_file(path, "error").decode(errors="replace"))
    except CheckpointError as exc:
        return Failure(rank, str(exc))


def _size(path: str) -> int:
    try:
        return os.stat(path).st_size
    except OSError:
        return -1
