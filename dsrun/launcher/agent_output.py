"""The node agent's output path: each rank's stdout/stderr, read line by
line, kept as a tail for the failure report, written to its ``--log_dir``
file and forwarded to the launcher as ``out`` events.

Invariants: a rank's pipes are read until they close, whatever happens to
its log file (a rank blocked on a full pipe would hang the job); a log file
that cannot be written (a full disk, a quota, EIO) is closed and dropped,
and said once through ``on_error``, which fails the host; closing a log
never raises. Kept to the standard library: every agent imports it.
"""

from __future__ import annotations

import math
import os
import select
import subprocess
import threading
import time
from collections.abc import Callable
from typing import IO, Any

from dsrun.launcher import procs
from dsrun.launcher.agent_os import hostname, open_rank_logs
from dsrun.launcher.link import Link
from dsrun.launcher.outlines import PARTIAL_IDLE, LineSplitter, Segment, Tail

TAIL_LINES = 20


class Rank:
    """One rank process of this agent and what is known of it."""

    def __init__(self, rank: int, local_rank: int, popen: subprocess.Popen,
                 leader: procs.Leader | None, error_file: str, stack_file: str) -> None:
        self.rank = rank
        self.local_rank = local_rank
        self.popen = popen
        self.leader = leader
        self.error_file = error_file
        self.stack_file = stack_file
        self.tail = Tail(TAIL_LINES)
        self.readers: list[threading.Thread] = []
        self.log: IO[str] | None = None
        self.reported = False
        self.status: int | None = None  # as Popen.returncode, known before it is reaped
        self.exit_mono = 0.0  # time.monotonic() when the exit was seen
        self.settled = False  # its wait thread saw the exit and its output is read
        self.shm_name = ""  # DeepSpeed's shared-memory all-reduce buffer, if it makes one


def guarded(target: Callable[..., None], on_error: Callable[[BaseException], None],
            *args: Any) -> threading.Thread:
    """A started daemon thread running ``target(*args)``; an exception that
    escapes it goes to ``on_error`` (the agent fails the host), never only to
    the thread excepthook, where nobody would act on it."""
    def run() -> None:
        try:
            target(*args)
        except BaseException as exc:  # noqa: BLE001 - handed to the agent's loop
            on_error(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


class RankOutput:
    """Reads, logs and forwards the ranks' output (see the module docstring).

    ``on_error(message)``: a log file could not be written; called once per
    file, from a reader thread. ``on_crash(exc)``: a reader failed otherwise.
    """

    def __init__(self, link: Link, on_error: Callable[[str], None],
                 on_crash: Callable[[BaseException], None]) -> None:
        self.link = link
        self.on_error = on_error
        self.on_crash = on_crash
        self.lock = threading.Lock()  # one writer per log file at a time

    def open_logs(self, payload: dict[str, Any]) -> dict[int, IO[str]]:
        """Every rank's ``--log_dir`` file, opened before any rank starts
        (LogOpenError names the first that cannot be opened)."""
        header = (f"# dsrun job {payload['job_id']} restart {payload.get('restart_count', 0)} "
                  f"host {hostname()} {time.strftime('%Y-%m-%d %H:%M:%S')}\n")
        return open_rank_logs(payload.get("log_dir"),
                              [spec["rank"] for spec in payload["ranks"]], header)

    def start_readers(self, rank: Rank) -> None:
        for fd, stream in ((1, rank.popen.stdout), (2, rank.popen.stderr)):
            rank.readers.append(guarded(self._pump, self.on_crash, rank, fd, stream))

    def _pump(self, rank: Rank, fd: int, stream: IO[bytes]) -> None:
        """Forward one output stream of ``rank`` line by line (outlines.py):
        ``\r`` ends a line too, and text without a line end goes out once it
        is PARTIAL_IDLE old (counted from its first byte, so a trickle of
        dots is not held for as long as it lasts) or LINE_LIMIT long."""
        splitter = LineSplitter()
        poller = select.poll()
        poller.register(stream.fileno(), select.POLLIN)
        since = 0.0  # time.monotonic() when the pending text's first byte was read
        while True:
            if splitter.pending:
                wait_ms = math.ceil(max(0.0, since + PARTIAL_IDLE - time.monotonic()) * 1000)
                if not poller.poll(wait_ms):  # nothing more came in time
                    self.forward(rank, fd, splitter.flush())
                    since = time.monotonic()  # a character cut in half waits again
                    continue
            data = os.read(stream.fileno(), 65536)
            if not data:
                break
            held = splitter.pending
            segments = splitter.feed(data)
            if segments or not held:  # what is pending now began in this read
                since = time.monotonic()
            elif time.monotonic() - since >= PARTIAL_IDLE:
                # More of the same unfinished line, and it is old enough: out
                # now. (Read first: after a pause the rest of a whole line may
                # already be in the pipe, and the line stays whole.)
                segments = splitter.flush()
                since = time.monotonic()
            self.forward(rank, fd, segments)
        self.forward(rank, fd, splitter.flush(final=True))
        stream.close()

    def forward(self, rank: Rank, fd: int, segments: list[Segment]) -> None:
        """One ``out`` event for the lines of one read (a chunk holds many)."""
        lines = []
        for segment in segments:
            rank.tail.add(fd, segment)
            if segment.forward:
                lines.append(segment.text)
        if not lines:
            return
        self.write_log(rank, "".join(f"{text}\n" for text in lines))
        self.link.send({"ev": "out", "rank": rank.rank, "fd": fd, "lines": lines}, False)

    def write_log(self, rank: Rank, text: str) -> None:
        """Append ``text`` to the rank's log file, if it has one. A file that
        cannot be written is dropped (the output still goes to the launcher)
        and said once: the job's log would be incomplete."""
        with self.lock:
            log = rank.log
            if log is None:
                return
            try:
                log.write(text)
                log.flush()
                return
            except (OSError, ValueError) as exc:
                rank.log = None
                close_quietly(log)
                what = f"[Errno {exc.errno}] {exc.strerror}" \
                    if isinstance(exc, OSError) and exc.strerror else str(exc)
        self.on_error(f"cannot write the --log_dir file {getattr(log, 'name', '?')} of rank "
                      f"{rank.rank}: {what}")

    def log_error(self, rank: Rank, error: dict[str, Any]) -> None:
        """A recorded error the rank did not print (a dsrun error is only
        recorded under an agent) goes into its --log_dir file too."""
        if rank.log is None or error.get("traceback") or not error.get("message"):
            return
        message = str(error["message"]).replace("\n", "\n#   ")
        where = f"\n#   at {error['where']}" if error.get("where") else ""
        self.write_log(rank, f"# dsrun: rank {rank.rank} failed: {message}{where}\n")

    def close_log(self, rank: Rank) -> None:
        with self.lock:
            log, rank.log = rank.log, None
        if log is not None:
            close_quietly(log)


def close_quietly(log: IO[str]) -> None:
    """Close a log file whose last flush may fail again (a full disk): the
    file is closed either way, and the teardown must go on."""
    try:
        log.close()
    except (OSError, ValueError):
        pass

