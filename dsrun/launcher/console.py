"""Everything the launcher writes: rank lines, its own messages, start-up progress.

Rank output goes to stdout (or stderr, as the rank wrote it) prefixed with
``[host:rank]``; dsrun's own messages go to stderr as ``dsrun: ...``.

While the hosts of a job connect and their agents start the ranks, a
multi-host job shows its progress, ``connected 12/32 hosts, 40/64 ranks
started``: on a terminal one line updated in place (cleared before any
other line is written, and redrawn after it); in a log (stderr not a
terminal) plain lines, at most one every :data:`PLAIN_EVERY` seconds and
one when each phase completes. Either way a last line says how long the
start took. Updates may come from any thread.

While a job runs (:meth:`Console.start_writer` to :meth:`Console.close`)
the console writes from threads of its own: whoever reports a line or a
message never waits for the terminal or the pipe behind dsrun's output.
There is one writer per destination. When stdout and stderr are the same
file (a terminal, ``>log 2>&1``, ``2>&1 | ...``) one writer writes both in
the order things were said; otherwise each stream has its own writer and
keeps its own order, so stderr (dsrun's messages, its report, the ranks'
stderr) never waits behind a slow reader of stdout, and there is no order
between the two streams (as when two processes write them directly).

:meth:`Console.pending` is the bytes still to write, both streams
together; the supervisor pauses the agents' output while it is high
(link.py), which is what bounds it. Consecutive texts for one stream go out
in one write and one flush of at most :data:`CHUNK` characters, so a
writer's progress is seen even behind a slow reader (:meth:`Console.stuck`).
A stream that fails takes nothing more: the next line or message for it,
and :meth:`Console.pending` (the supervisor asks at every step), raise in
the caller, which stops the job - ``BrokenPipeError`` for a closed pipe
(``dsrun ... | head``: dsrun then exits quietly, as a direct write would
end it), :class:`OutputFailed` for any other error (a full disk, a file
size limit, EIO), which dsrun names on stderr. A stream given up on (:meth:`Console.drop`: its
reader stopped reading after the job ended, or a signal) loses what is
queued for it and silently takes nothing more.
"""

from __future__ import annotations

import collections
import errno
import functools
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import IO, Any

from dsrun.launcher.backends.base import AGENT_LINE

#: Seconds between two progress lines when stderr is not a terminal.
PLAIN_EVERY = 2.0
#: The most characters one write takes (a pipe's capacity).
CHUNK = 64 * 1024
_CLEAR = "\r\x1b[K"
OUT, ERR = 1, 2


class OutputFailed(Exception):
    """A write to dsrun's stdout or stderr failed, other than into a closed
    pipe (ENOSPC, EFBIG, EIO): ``error`` is the OSError."""

    def __init__(self, fd: int, error: OSError) -> None:
        self.stream = "stdout" if fd == OUT else "stderr"
        self.error = error
        self.job_code: int | None = None  # the job's exit code, when it had ended first
        what = f"[Errno {error.errno}] {error.strerror}" if error.strerror else str(error)
        super().__init__(f"cannot write to {self.stream}: {what}")

    def line(self) -> str:
        """What dsrun says of it on stderr (if stderr still works)."""
        if self.job_code is None:
            return f"{self}: the job was stopped (its output from there on is lost)"
        return f"{self}: the rest of the job's output is lost (the job had ended, " \
               f"exit code {self.job_code})"


def checked_writes(write: Callable[[str], None], fd: int) -> Callable[[str], None]:
    """``write`` (a direct write, outside any console: ``dsrun stack``) with
    an error other than a closed pipe raised as :class:`OutputFailed`."""
    return functools.partial(_checked, fd, write)


def _checked(fd: int, write: Callable[..., None], *args: Any) -> None:
    """``write(*args)``, an error other than a closed pipe raised as
    :class:`OutputFailed` for stream ``fd``."""
    try:
        write(*args)
    except OSError as exc:
        if _closed_pipe(exc):
            raise
        raise OutputFailed(fd, exc) from exc


def _closed_pipe(exc: BaseException) -> bool:
    """A pipe whose reader is gone (or a stream closed under us): the quiet end."""
    return isinstance(exc, ValueError) or \
        (isinstance(exc, OSError) and exc.errno in (errno.EPIPE, errno.ECONNRESET, None))


class _Writer:
    """One thread writing one destination's queued texts, in order (the
    console's lock guards every field)."""

    def __init__(self, fds: set[int]) -> None:
        self.fds = fds  # OUT, ERR, or both when they are the same file
        self.queue: collections.deque[tuple[int, str]] = collections.deque()
        self.busy = False  # writing what it took
        self.progress = time.monotonic()  # last write done, or work begun after idling
        self.thread: threading.Thread | None = None

    def has_work(self) -> bool:
        return bool(self.queue) or self.busy


class Console:
    def __init__(self, out: IO[str] | None = None, err: IO[str] | None = None,
                 tty: bool | None = None) -> None:
        self._out = out  # None: sys.stdout / sys.stderr at each write (main()
        self._err = err  # replaces a closed one by os.devnull)
        self.tty = _isatty(self.err) if tty is None else tty
        self._lock = threading.RLock()
        self._cond = threading.Condition(self._lock)
        self._progress: _Progress | None = None
        self._shown = False  # the progress line is on the terminal now
        self._writers: dict[int, _Writer] = {}  # by stream; empty: write directly
        self._ending = False  # close(): writers end once their queue is empty
        self._broken: set[int] = set()  # streams that failed
        self._failed: dict[int, OSError] = {}  # ... with an error other than a closed pipe
        self._dropped: set[int] = set()  # streams given up on (drop())
        self._backlog = {OUT: 0, ERR: 0}  # characters queued or being written

    @property
    def out(self) -> IO[str]:
        return self._out or sys.stdout

    @property
    def err(self) -> IO[str]:
        return self._err or sys.stderr

    @property
    def backlog(self) -> int:
        return self._backlog[OUT] + self._backlog[ERR]

    def _stream(self, fd: int) -> IO[str]:
        return self.out if fd == OUT else self.err

    # -- plain output -----------------------------------------------------------
    def line(self, host: str, rank: int, fd: int, text: str) -> None:
        """One line of a rank (rank >= 0), an agent or a launching tool."""
        self.lines(host, rank, fd, [text])

    def lines(self, host: str, rank: int, fd: int, texts: list[str]) -> None:
        """Lines of one rank's (agent's, tool's) stream, written together."""
        who = f"{host}:{rank}" if rank >= 0 else f"{host}:agent" if rank == AGENT_LINE else host
        self._write(OUT if fd == 1 else ERR,
                    "".join(f"[{who}] {text}\n" for text in texts))

    def say(self, message: str) -> None:
        self._write(ERR, f"dsrun: {message}\n")

    def _write(self, fd: int, text: str) -> None:
        with self._lock:
            if self._shown:
                self._put(ERR, _CLEAR)
                self._shown = False
            self._put(fd, text)
            self._redraw()

    def _put(self, fd: int, text: str) -> None:
        """Write ``text`` now, or queue it for its writer (lock held)."""
        if fd in self._broken:
            self._raise_failed(fd, f"({text[:40]!r} lost)")
        if fd in self._dropped:
            return
        writer = self._writers.get(fd)
        if writer is None:
            _checked(fd, _write_text, self._stream(fd), text)
            return
        if not writer.has_work():
            writer.progress = time.monotonic()  # a stall counts from here
        writer.queue.append((fd, text))
        self._backlog[fd] += len(text)
        self._cond.notify_all()

    # -- the writer threads -------------------------------------------------
    def start_writer(self) -> None:
        """From now on write from threads of our own (module docstring)."""
        with self._lock:
            if self._writers:
                return
            # A new job's output: a stream that failed or was given up on in an
            # earlier launch.run of this process may well work now.
            self._broken.clear()
            self._failed.clear()
            self._dropped.clear()
            self._backlog = {OUT: 0, ERR: 0}
            self._ending = False
            if _same_file(self.out, self.err):
                both = _Writer({OUT, ERR})
                self._writers = {OUT: both, ERR: both}
            else:
                self._writers = {OUT: _Writer({OUT}), ERR: _Writer({ERR})}
            for writer in self._unique():
                name = "dsrun-console" if len(writer.fds) > 1 else \
                    f"dsrun-{'stdout' if OUT in writer.fds else 'stderr'}"
                writer.thread = threading.Thread(target=self._write_queued, args=(writer,),
                                                 daemon=True, name=name)
                writer.thread.start()

    def _unique(self) -> list[_Writer]:
        return list({id(w): w for w in self._writers.values()}.values())

    def pending(self) -> int:
        """Characters still to write, both streams; raises ``BrokenPipeError``
        or :class:`OutputFailed` once a stream has failed (the job then
        stops, as a failed direct write stops it)."""
        with self._lock:
            if self._broken:
                self._raise_failed(min(self._failed or self._broken))
            return self.backlog

    def _raise_failed(self, fd: int, what: str = "") -> None:
        error = self._failed.get(fd)
        if error is not None:
            raise OutputFailed(fd, error)
        raise BrokenPipeError(f"dsrun's output stream is closed{' ' + what if what else ''}")

    @property
    def failure(self) -> OutputFailed | None:
        """The first stream that failed other than as a closed pipe, if any."""
        with self._lock:
            fd = min(self._failed, default=None)
            return None if fd is None else OutputFailed(fd, self._failed[fd])

    def behind(self, fd: int) -> int:
        """Characters still to write to one stream (1: stdout, 2: stderr)."""
        with self._lock:
            return self._backlog[fd]

    def stuck(self, fd: int, since: float = 0.0) -> float:
        """Seconds the writer of stream ``fd`` has had work but written
        nothing, counted from ``since`` at the earliest; 0 when it is idle."""
        with self._lock:
            writer = self._writers.get(fd)
            if writer is None or not writer.has_work():
                return 0.0
            return max(0.0, time.monotonic() - max(writer.progress, since))

    def written(self, timeout: float | None = None) -> bool:
        """Wait until every writer has written what it was given, except
        for streams given up on; False if ``timeout`` passed first."""
        with self._lock:
            return self._cond.wait_for(self._all_written, timeout)

    def _all_written(self) -> bool:
        return all(not w.has_work() or w.fds <= self._dropped for w in self._unique())

    def drop(self, fd: int) -> tuple[int, int]:
        """Give up on stream ``fd``: what is queued for it is dropped, and it
        takes nothing more (a write already under way may still end). The
        lines and bytes (UTF-8) dropped."""
        with self._lock:
            self._dropped.add(fd)
            writer = self._writers.get(fd)
            gone = self._drop_queued(writer, fd) if writer is not None else []
            self._cond.notify_all()
        return (sum(text.count("\n") for text in gone),
                sum(len(text.encode("utf-8", "replace")) for text in gone))

    def _drop_queued(self, writer: _Writer, fd: int) -> list[str]:
        gone = [text for f, text in writer.queue if f == fd]
        writer.queue = collections.deque(q for q in writer.queue if q[0] != fd)
        self._backlog[fd] -= sum(len(text) for text in gone)
        return gone

    def close(self, wait: bool = True) -> bool:
        """End the writer threads and write directly again; True if a stream
        failed. ``wait``: first write everything queued, waiting for the
        readers as long as it takes; else what is still queued is dropped
        and a writer blocked in a write is left behind (a daemon thread)."""
        if wait:
            self.written()
        with self._lock:
            if not wait:
                for fd in (OUT, ERR):
                    if self._writers.get(fd) is not None and self._writers[fd].has_work():
                        self.drop(fd)
            writers = self._unique()
            self._ending = True
            self._writers = {}
            self._cond.notify_all()
        for writer in writers:
            if writer.thread is not None and not (writer.busy and not wait):
                writer.thread.join()
        return bool(self._broken)

    def _take(self, writer: _Writer) -> tuple[int, str] | None:
        """The next queued texts of one stream, joined up to CHUNK
        characters (lock held); None once the writer is to end."""
        while not writer.queue:
            if self._ending:
                return None
            self._cond.wait()
        fd, text = writer.queue.popleft()
        parts, size = [text], len(text)
        while writer.queue and writer.queue[0][0] == fd \
                and size + len(writer.queue[0][1]) <= CHUNK:
            size += len(writer.queue[0][1])
            parts.append(writer.queue.popleft()[1])
        if size > CHUNK:  # one long text: its first lines now, the rest next
            cut = text.rfind("\n", 0, CHUNK) + 1 or text.find("\n", CHUNK) + 1 or len(text)
            if cut < len(text):
                writer.queue.appendleft((fd, text[cut:]))
                parts = [text[:cut]]
        return fd, "".join(parts)

    def _write_queued(self, writer: _Writer) -> None:
        while True:
            with self._lock:
                taken = self._take(writer)
                if taken is None:
                    return
                writer.busy = True
            fd, text = taken
            try:
                _write_text(self._stream(fd), text)
            except Exception as exc:  # noqa: BLE001 - a failed stream takes nothing more
                with self._lock:
                    self._broken.add(fd)
                    if isinstance(exc, OSError) and not _closed_pipe(exc):
                        self._failed.setdefault(fd, exc)
                    self._drop_queued(writer, fd)
            finally:
                with self._lock:
                    writer.busy = False
                    writer.progress = time.monotonic()
                    self._backlog[fd] -= len(text)
                    self._cond.notify_all()

    # -- progress -----------------------------------------------------------
    def start_progress(self, hosts: int, ranks: int, unit: str = "hosts") -> None:
        with self._lock:
            self._progress = _Progress(hosts, ranks, unit, time.monotonic())
            self._update(force=True)

    def connected(self, host: str) -> None:
        with self._lock:
            if self._progress is not None:
                self._progress.connected += 1
                self._update(force=self._progress.connected == self._progress.hosts)

    def started(self, count: int) -> None:
        with self._lock:
            progress = self._progress
            if progress is not None and count != progress.started:
                progress.started = count
                if count >= progress.ranks:
                    self.end_progress()
                else:
                    self._update()

    def end_progress(self) -> None:
        """The last progress line (with the time taken); no more updates."""
        with self._lock:
            progress, self._progress = self._progress, None
            if progress is None:
                return
            if self._shown:
                self._put(ERR, _CLEAR)
                self._shown = False
            took = time.monotonic() - progress.began
            self._put(ERR, f"dsrun: {progress.text()} in {took:.1f}s\n")

    def _update(self, force: bool = False) -> None:
        progress = self._progress
        if progress is None:
            return
        if self.tty:
            self._redraw()
            return
        now = time.monotonic()
        if force or now - progress.printed >= PLAIN_EVERY:
            progress.printed = now
            self._put(ERR, f"dsrun: {progress.text()}\n")

    def _redraw(self) -> None:
        if self.tty and self._progress is not None:
            self._put(ERR, f"{_CLEAR}dsrun: {self._progress.text()}")
            self._shown = True


class _Progress:
    def __init__(self, hosts: int, ranks: int, unit: str, began: float) -> None:
        self.hosts = hosts
        self.ranks = ranks
        self.unit = unit
        self.began = began
        self.connected = 0
        self.started = 0
        self.printed = 0.0

    def text(self) -> str:
        return (f"connected {self.connected}/{self.hosts} {self.unit}, "
                f"{self.started}/{self.ranks} ranks started")


def _write_text(stream: IO[str], text: str) -> None:
    try:
        stream.write(text)
    except UnicodeEncodeError:  # a stream that cannot encode everything: as "replace"
        encoding = getattr(stream, "encoding", None) or "ascii"
        stream.write(text.encode(encoding, "replace").decode(encoding))
    stream.flush()


def _same_file(a: IO[str], b: IO[str]) -> bool:
    """Whether two streams write to one file (a terminal, a pipe, a log)."""
    if a is b:
        return True
    try:
        sa, sb = os.fstat(a.fileno()), os.fstat(b.fileno())
    except (AttributeError, OSError, ValueError):  # io.UnsupportedOperation is both
        return False
    return (sa.st_dev, sa.st_ino) == (sb.st_dev, sb.st_ino)


def _isatty(stream: IO[str]) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False
