"""Saving: every rank writes its own slices, rank 0 commits the directory.

:func:`save_state` is the Python API any engine calls (the ZeRO engine
through :mod:`.engine_io`; a pipeline engine with its own sources)::

    1. agree      every rank posts the tag (Coordinator.agree, with a
                  deadline): missing ranks and different tags are named,
                  and so is what one rank found wrong (a bad or too long
                  tag, a client_state that is not a dict, one that does not
                  pickle); nothing on disk changes before, so a save
                  refused here wrote nothing
    2. check      rank 0 removes a TAG.tmp/ left by a crashed save, checks
                  the bytes every rank will write against the free space,
                  makes SAVE_DIR and TAG.tmp/ with this save's id, and
                  tells every rank how that went and the id (no rank
                  writes before); a rank that cannot read it back fails
                  the save on every rank: SAVE_DIR is not shared (.sharing)
    3. write      each rank writes rank_RRRRR.bin (its fragments; replicated
                  ones split among their holders), fsyncs it, then its
                  record rank_RRRRR.json (atomically); rank 0 also
                  engine_state.pt - all into SAVE_DIR/TAG.tmp/
    4. commit     once every rank has finished, rank 0 merges the records
                  into manifest.json (fsynced), renames TAG.tmp/ to TAG/,
                  then writes ``latest`` (temp file + rename) and, as
                  DeepSpeed copies its script there, SAVE_DIR/zero_to_fp32.py

A crash at any point leaves ``latest`` naming the previous tag, whose
directory is untouched. Synchronous saves learn each other's outcome after
steps 3 and 4 through ``Coordinator.exchange`` and all raise the same
error; an asynchronous save (:mod:`.async_save`) copies the fragments to
host memory in the caller's thread and runs steps 3-4 in a background
thread, where rank 0 waits for the other ranks' records on the shared
file system (:mod:`.record_wait`; no collective runs outside the caller's thread); a rank whose
part fails posts its error on the save's :class:`~.coord.SaveBoard` (the
store: a full disk cannot stop it), where rank 0's committer and the
other ranks' writers see it within a poll and stop.

After a successful commit rank 0 removes interrupted saves of *other* tags
(``OTHER.tmp/``) that hold only dsrun's files and have not changed for
``checkpoint.timeout`` seconds - the time after which a committer gives a
silent rank up - so no save still running can be writing them.
"""

from __future__ import annotations

import io
import json
import logging
import os
import socket
import time
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

from dsrun.errors import CheckpointError
from dsrun.runtime.checkpoint.coord import (
    Coordinator,
    Failure,
    SaveBoard,
    check_same,
    raise_failures,
    raise_first,
)
from dsrun.runtime.checkpoint.fragments import ExportedState
from dsrun.runtime.checkpoint.info import size_texts
from dsrun.runtime.checkpoint.manifest import (
    ENGINE_STATE,
    LATEST,
    MANIFEST,
    REPLACED_SUFFIX,
    TMP_SUFFIX,
    error_file,
    rank_file,
    record_file,
)
from dsrun.runtime.checkpoint.rank_plan import (  # noqa: F401 - Planned, own_share: re-exported
    Planned,
    RankPlan,
    own_share,
    plan_rank,
)
from dsrun.runtime.checkpoint.record_wait import (  # noqa: F401 - RecordsTimedOut: re-exported
    RankFailed,
    RecordsTimedOut,
    wait_for_records,
)
from dsrun.runtime.checkpoint.records import ChunkRecord, RankRecord, merge_records
from dsrun.runtime.checkpoint.recovery_script import write_recovery_script
from dsrun.runtime.checkpoint.settings import PausePoint
from dsrun.runtime.checkpoint.sharing import check_save_shared, remove_mark, write_mark
from dsrun.runtime.checkpoint.storage import (
    DataFile,
    atomic_write,
    free_bytes,
    fsync_dir,
    read_file,
    remove_tree,
    tensor_bytes,
)
from dsrun.runtime.checkpoint.tags import (
    check_tag,
    check_tag_fits,
    nearest_existing,
    read_latest,
    remove_stale_saves,
)

log = logging.getLogger("dsrun.runtime.checkpoint")

SPACE_MARGIN = 1.02  # records, manifest and file-system overhead
# what a failure before the commit's rename leaves as it was
INTACT = "the previous checkpoint is intact"
BOARD_CHECK_S = 0.2  # how often a writer looks for another rank's failure


@dataclass
class RankWrite:
    """Step 3 for this rank; runs in the caller's thread or a background one."""

    tmp_dir: str
    rank: int
    plan: RankPlan
    extra: Mapping[str, Any]
    engine_blob: Optional[bytes] = None
    pause: Optional[PausePoint] = None
    tag: str = ""
    durable: bool = True
    board: Optional[SaveBoard] = None  # asynchronous saves of several ranks

    def run(self) -> None:
        try:
            self._write()
        except OSError as exc:  # the directory or a file cannot be made (read-only, removed)
            raise CheckpointError(f"writing rank {self.rank}'s checkpoint files into "
                                  f"{self.tmp_dir} failed: {exc}; {INTACT}") from None

    def _write(self) -> None:
        if self.board is not None:  # after a failure rank 0 removes TAG.tmp/ (maybe did):
            # a late rank must not make it again
            self._stop_if_another_failed()
        os.makedirs(self.tmp_dir, exist_ok=True)
        path = os.path.join(self.tmp_dir, rank_file(self.rank))
        halfway = len(self.plan.chunks) // 2
        check_at = time.monotonic() + BOARD_CHECK_S
        with DataFile(path, self.plan.bytes, self.durable, note=INTACT) as out:
            for i, chunk in enumerate(self.plan.chunks):
                if i == halfway and self.pause:
                    self.pause.reached(self.rank, "write", self.tag)
                if self.board is not None and time.monotonic() >= check_at:
                    self._stop_if_another_failed()
                    check_at = time.monotonic() + BOARD_CHECK_S
                out.append(tensor_bytes(chunk.tensor))
            crcs = out.close()
        records = [ChunkRecord(c.name, c.item, c.dtype, c.offset, c.start, c.end, crc)
                   for c, crc in zip(self.plan.chunks, crcs)]
        files = {}
        if self.engine_blob is not None:  # the commit fsyncs the directory
            atomic_write(os.path.join(self.tmp_dir, ENGINE_STATE), self.engine_blob, False,
                         self.durable, INTACT)
            files[ENGINE_STATE] = {"bytes": len(self.engine_blob),
                                   "crc32": zlib.crc32(self.engine_blob)}
        record = RankRecord(self.rank, self.plan.bytes, self.plan.tensors, tuple(records),
                            self.plan.scalars, self.plan.groups, self.plan.optimizer, files,
                            self.extra)
        atomic_write(os.path.join(self.tmp_dir, record_file(self.rank)),
                     json.dumps(record.to_json(), separators=(",", ":")).encode(), False,
                     self.durable, INTACT)

    def _stop_if_another_failed(self) -> None:
        assert self.board is not None
        failure = self.board.first()
        if failure is not None and failure.rank != self.rank:
            raise RankFailed(failure)

    def fail(self, failure: Failure) -> None:
        """Tell rank 0's committer and the other writers (asynchronous
        saves) that this rank stopped: on the board, else (no store) in an
        error file next to the data. Rank 0 is the committer itself: its
        error file would have no reader."""
        if failure.rank != self.rank:  # stopped by that rank's failure
            failure = Failure(self.rank, failure.message, cause=False)
        if self.board is not None and self.board.post(failure):
            return
        if self.rank == 0:
            return
        try:
            atomic_write(os.path.join(self.tmp_dir, error_file(self.rank)),
                         failure.message.encode(), False)
        except Exception as exc:  # noqa: BLE001 - rank 0 then times out waiting, naming this rank
            log.warning("could not tell rank 0 that rank %d's save failed (%s): rank 0 gives "
                        "up on it after checkpoint.timeout", self.rank, exc)
            log.debug("writing the error file failed", exc_info=True)


@dataclass(frozen=True)
class Commit:
    """Step 4, run by rank 0 once every rank's record exists."""

    save_dir: str
    tag: str
    world: int
    meta: Mapping[str, Any]
    aliases: Mapping[str, str]
    save_latest: bool
    pause: Optional[PausePoint] = None
    durable: bool = True
    stale_after_s: float = 600.0  # remove_stale_saves: checkpoint.timeout

    @property
    def tmp_dir(self) -> str:
        return os.path.join(self.save_dir, self.tag + TMP_SUFFIX)

    def run(self) -> None:
        remove_mark(self.tmp_dir)
        records, files = [], {}
        for rank in range(self.world):
            path = os.path.join(self.tmp_dir, record_file(rank))
            text = read_file(path, f"rank {rank}'s record")
            records.append(RankRecord.from_json(json.loads(text), path))
            files[record_file(rank)] = {"bytes": len(text), "crc32": zlib.crc32(text)}
        manifest = merge_records(records, self.tag, files, self.meta, self.aliases)
        atomic_write(os.path.join(self.tmp_dir, MANIFEST), manifest.dumps().encode(), False,
                     self.durable, INTACT)
        if self.durable:
            fsync_dir(self.tmp_dir)  # every file of the tag, durable before the rename
        if self.pause:
            self.pause.reached(0, "commit", self.tag)
        replace_dir(self.tmp_dir, os.path.join(self.save_dir, self.tag))
        if self.durable:
            fsync_dir(self.save_dir)
        if self.pause:
            self.pause.reached(0, "latest", self.tag)
        if self.save_latest:
            self._write_latest()
        try:
            write_recovery_script(self.save_dir)
        except CheckpointError as exc:  # a full disk: the checkpoint stands all the same
            log.warning("%s (checkpoint %r is complete)", exc, self.tag)
        remove_stale_saves(self.save_dir, self.tag, self.stale_after_s)

    def _write_latest(self) -> None:
        """``latest`` names the new tag; a failure here comes after the tag's
        rename, so the error says the tag is complete and what ``latest``
        still names."""
        try:
            atomic_write(os.path.join(self.save_dir, LATEST), self.tag.encode(),
                         durable=self.durable)
        except (CheckpointError, OSError) as exc:
            try:
                previous = read_latest(self.save_dir)
            except CheckpointError:
                previous = None
            still = f"still names {previous!r}" if previous else "was not written"
            raise CheckpointError(
                f"checkpoint {self.tag!r} is complete in {os.path.join(self.save_dir, self.tag)} "
                f"and loads by its tag (load_checkpoint(..., tag={self.tag!r})), but "
                f"{LATEST} {still}: updating it failed: {exc}") from None

    def wait_for_records(self, timeout_s: float, others_only: bool = False,
                         board: Optional[SaveBoard] = None, settle: bool = False) -> None:
        """Asynchronous saves: :func:`.record_wait.wait_for_records` in
        ``TAG.tmp/``."""
        wait_for_records(self.tmp_dir, self.world, timeout_s, others_only, board, settle)


def replace_dir(tmp: str, final: str) -> None:
    """Rename ``tmp`` to ``final``; an existing ``final`` (the same tag saved
    again) is moved aside first and removed after."""
    aside = final + REPLACED_SUFFIX
    if os.path.isdir(final):
        remove_tree(aside)
        os.rename(final, aside)
    os.rename(tmp, final)
    remove_tree(aside)


def engine_blob(state: Mapping[str, Any]) -> bytes:
    buffer = io.BytesIO()
    torch.save(dict(state), buffer)
    return buffer.getvalue()


def _status(run: Callable[[], None]) -> Optional[str]:
    try:
        run()
    except CheckpointError as exc:
        return str(exc)
    except Exception as exc:  # noqa: BLE001 - reported to every rank, then raised
        return describe_failure(exc)
    return None


def describe_failure(exc: Exception) -> str:
    """One line for a step that raised something else than a
    :class:`CheckpointError`; the traceback is logged only at debug level for
    an ``OSError`` or a ``MemoryError`` (the system's answer, not a bug),
    always otherwise (it may be dsrun's bug: the traceback finds it)."""
    if isinstance(exc, (OSError, MemoryError, torch.cuda.OutOfMemoryError)):
        log.debug("checkpoint step failed", exc_info=exc)
    else:
        log.error("checkpoint step failed", exc_info=exc)
    return f"{type(exc).__name__}: {exc}"


@dataclass(frozen=True)
class SaveRequest:
    """One save (module docstring). ``engine_state`` is pickled by rank 0 only."""

    save_dir: str
    tag: str
    save_latest: bool = True
    meta: Mapping[str, Any] = field(default_factory=dict)
    aliases: Mapping[str, str] = field(default_factory=dict)
    engine_state: Optional[Mapping[str, Any]] = None
    extra: Mapping[str, Any] = field(default_factory=dict)
    durable: bool = True   # fsync files and directories ("checkpoint": {"fsync": ...})
    # what the caller found wrong with this rank's arguments (a client_state
    # that is not a dict): raised on every rank, as the writer's own checks
    problem: Optional[str] = None


def _prepare(request: SaveRequest, exports: Sequence[ExportedState], rank: int, save_dir: str
             ) -> tuple[RankPlan, Optional[bytes]]:
    """What can fail on one rank alone, before the agreement: (plan, rank 0's
    engine state). Changes nothing on disk; raises, the caller reports it."""
    if request.problem:
        raise CheckpointError(request.problem)
    plan = plan_rank(exports)
    check_tag(request.tag)
    check_tag_fits(request.tag, save_dir)
    if rank != 0:
        return plan, None
    return plan, engine_blob(request.engine_state) if request.engine_state is not None else None


def check_space(save_dir: str, tag: str, total: int, free: Optional[int]) -> None:
    """The ``total`` bytes of all ranks (and a margin) against the free space."""
    if free is not None and total * SPACE_MARGIN > free:
        need, data, have = size_texts(int(total * SPACE_MARGIN), total, free)
        raise CheckpointError(
            f"not enough space in {save_dir} for checkpoint {tag!r}: it needs {need} "
            f"({data} of data + {SPACE_MARGIN - 1:.0%} for records and file-system overhead), "
            f"{have} are free; free space or save to another directory (nothing was written; "
            "the previous checkpoint is intact)")


def make_room(save_dir: str, tag: str, total: int) -> str:
    """Step 2, rank 0, once every rank agreed: remove this tag's ``TAG.tmp/``
    left by a crashed save, check the space for ``total`` bytes, make
    ``save_dir`` and ``TAG.tmp/`` with this save's id (returned) in it."""
    tmp_dir = os.path.join(save_dir, f"{tag}{TMP_SUFFIX}")
    try:
        remove_tree(tmp_dir)
        check_space(save_dir, tag, total, free_bytes(nearest_existing(save_dir)))
        os.makedirs(save_dir, exist_ok=True)
    except OSError as exc:
        raise CheckpointError(f"cannot save checkpoint {tag!r} in {save_dir}: {exc}; "
                              f"{INTACT}") from None
    try:
        return write_mark(tmp_dir)
    except OSError as exc:  # a file in the way, a read-only file system, a full disk
        remove_tree(tmp_dir)
        raise CheckpointError(f"cannot save checkpoint {tag!r}: making {tmp_dir} failed: "
                              f"{exc}; {INTACT}") from None


def begin_save(request: SaveRequest, exports: Sequence[ExportedState], coord: Coordinator,
               pause: Optional[PausePoint] = None) -> tuple[RankWrite, Commit]:
    """Steps 1-2 (module docstring): returns this rank's write and the commit.
    Anything that fails on some ranks only is raised on all of them."""
    save_dir = os.path.abspath(str(request.save_dir))
    plan, blob, problem = RankPlan(), None, None
    try:
        plan, blob = _prepare(request, exports, coord.rank, save_dir)
    except (CheckpointError, OSError, ValueError) as exc:
        problem = str(exc)
    except Exception as exc:  # noqa: BLE001 - e.g. an unpicklable client_state
        problem = f"{type(exc).__name__}: {exc}"
    mine = {"tag": str(request.tag), "save_latest": request.save_latest, "bytes": plan.bytes,
            "problem": problem, "host": socket.gethostname()}
    everyone = coord.agree("engine.save_checkpoint()", mine)
    check_same([e["tag"] for e in everyone], "the checkpoint tag")
    check_same([e["save_latest"] for e in everyone], "save_latest")
    raise_failures([e["problem"] for e in everyone], f"saving checkpoint {request.tag!r}")
    total = sum(e["bytes"] for e in everyone)
    room, save_id = None, None
    if coord.rank == 0:
        def room_for_it() -> None:
            nonlocal save_id
            save_id = make_room(save_dir, request.tag, total)
        room = _status(room_for_it)
    room, save_id = coord.exchange((room, save_id) if coord.rank == 0 else None)[0]
    raise_first([room], f"saving checkpoint {request.tag!r}")
    tmp_dir = os.path.join(save_dir, f"{request.tag}{TMP_SUFFIX}")
    check_save_shared(coord, tmp_dir, save_id, save_dir, request.tag,
                      [e.get("host", "?") for e in everyone])
    write = RankWrite(tmp_dir, coord.rank, plan, request.extra, blob, pause, request.tag,
                      request.durable)
    commit = Commit(save_dir, request.tag, coord.world, request.meta, request.aliases,
                    request.save_latest, pause, request.durable, coord.timeout_s)
    return write, commit


def save_state(request: SaveRequest, exports: Sequence[ExportedState], coord: Coordinator,
               pause: Optional[PausePoint] = None) -> str:
    """A synchronous save (module docstring); returns the tag's directory.
    Every rank of the default group must call it with the same tag."""
    write, commit = begin_save(request, exports, coord, pause)
    try:
        statuses = coord.exchange(_status(write.run))
    except BaseException:
        # a rank left (or this one is leaving) during the write: nothing
        # will commit TAG.tmp/, which rank 0 removes (the next save would)
        if coord.rank == 0:
            remove_tree(commit.tmp_dir)
        raise
    if any(statuses) and coord.rank == 0:
        remove_tree(commit.tmp_dir)
    raise_failures(statuses, f"saving checkpoint {request.tag!r}")
    status = _status(commit.run) if coord.rank == 0 else None
    if status and coord.rank == 0:
        remove_tree(commit.tmp_dir)
    raise_failures(coord.exchange(status), f"committing checkpoint {request.tag!r}")
    log.info("saved checkpoint %s", os.path.join(commit.save_dir, request.tag))
    return os.path.join(commit.save_dir, request.tag)


def save_alone(request: SaveRequest, exports: Sequence[ExportedState]) -> str:
    """A save written by this process alone, as the one rank of a world of
    one, with no process group: for offline tools that write a checkpoint
    (the DeepSpeed importer). Steps 2-4 of the module docstring, the same
    files and guarantees; a failure removes ``TAG.tmp/``. Returns the tag's
    directory."""
    save_dir = os.path.abspath(str(request.save_dir))
    plan, blob = _prepare(request, exports, 0, save_dir)
    make_room(save_dir, request.tag, plan.bytes)
    write = RankWrite(os.path.join(save_dir, f"{request.tag}{TMP_SUFFIX}"), 0, plan,
                      request.extra, blob, tag=request.tag, durable=request.durable)
    commit = Commit(save_dir, request.tag, 1, request.meta, request.aliases, request.save_latest,
                    durable=request.durable)
    try:
        write.run()
        commit.run()
    except BaseException:
        remove_tree(commit.tmp_dir)
        raise
    return os.path.join(save_dir, request.tag)
