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
the console writes from a thread of its own, in the order things were
said: whoever reports a line or a message never waits for the terminal or
the pipe behind dsrun's stdout. :meth:`Console.pending` is the bytes still
to write; the supervisor pauses the agents' output while it is high
(link.py), which is what bounds it. Consecutive texts for one stream go out
in one write and one flush. A stream that fails (a closed pipe:
``dsrun ... | head``) takes nothing more: the next line or message for it,
and :meth:`Console.pending` (the supervisor asks at every step), raise
``BrokenPipeError`` in the caller, as a direct write would.
"""

from __future__ import annotations

import collections
import sys
import threading
import time
from typing import IO

from dsrun.launcher.backends.base import AGENT_LINE

#: Seconds between two progress lines when stderr is not a terminal.
PLAIN_EVERY = 2.0
_CLEAR = "\r\x1b[K"


class Console:
    def __init__(self, out: IO[str] | None = None, err: IO[str] | None = None,
                 tty: bool | None = None) -> None:
        self._out = out  # None: sys.stdout / sys.stderr at each write (main()
        self._err = err  # replaces a closed one by os.devnull)
        self.tty = _isatty(self.err) if tty is None else tty
        self._lock = threading.RLock()
        self._progress: _Progress | None = None
        self._shown = False  # the progress line is on the terminal now
        # the writer thread's queue: (stream, text), and what it holds
        self._queue: collections.deque[tuple[IO[str], str]] = collections.deque()
        self._cond = threading.Condition(self._lock)
        self._writer: threading.Thread | None = None
        self._busy = False  # the writer is writing what it took
        self._broken: set[int] = set()  # id() of streams that failed
        self.backlog = 0  # bytes queued, not yet written

    @property
    def out(self) -> IO[str]:
        return self._out or sys.stdout

    @property
    def err(self) -> IO[str]:
        return self._err or sys.stderr

    # -- plain output -----------------------------------------------------------
    def line(self, host: str, rank: int, fd: int, text: str) -> None:
        """One line of a rank (rank >= 0), an agent or a launching tool."""
        self.lines(host, rank, fd, [text])

    def lines(self, host: str, rank: int, fd: int, texts: list[str]) -> None:
        """Lines of one rank's (agent's, tool's) stream, written together."""
        who = f"{host}:{rank}" if rank >= 0 else f"{host}:agent" if rank == AGENT_LINE else host
        self._write(self.out if fd == 1 else self.err,
                    "".join(f"[{who}] {text}\n" for text in texts))

    def say(self, message: str) -> None:
        self._write(self.err, f"dsrun: {message}\n")

    def _write(self, stream: IO[str], text: str) -> None:
        with self._lock:
            if self._shown:
                self._put(self.err, _CLEAR)
                self._shown = False
            self._put(stream, text)
            self._redraw()

    def _put(self, stream: IO[str], text: str) -> None:
        """Write ``text`` now, or queue it for the writer thread (lock held)."""
        if id(stream) in self._broken:
            raise BrokenPipeError(f"dsrun's output stream is closed ({text[:40]!r} lost)")
        if self._writer is None:
            _write_text(stream, text)
            return
        self._queue.append((stream, text))
        self.backlog += len(text)
        self._cond.notify_all()

    # -- the writer thread --------------------------------------------------
    def start_writer(self) -> None:
        """From now on write from a thread of our own (module docstring)."""
        with self._lock:
            if self._writer is None:
                self._writer = threading.Thread(target=self._write_queued, daemon=True,
                                                name="dsrun-console")
                self._writer.start()

    def pending(self) -> int:
        """Bytes still to write; raises ``BrokenPipeError`` once a stream
        has failed (the job then stops, as a failed direct write stops it)."""
        with self._lock:
            if self._broken:
                raise BrokenPipeError("dsrun's output stream is closed")
            return self.backlog

    def close(self) -> bool:
        """Write everything queued (waiting for the reader as long as it
        takes), then write directly again; True if a stream failed."""
        with self._lock:
            writer = self._writer
            if writer is not None:
                while self._queue or self._busy:
                    self._cond.wait(0.5)
                self._writer = None
                self._cond.notify_all()
        if writer is not None:
            writer.join()
        return bool(self._broken)

    def _take(self) -> tuple[IO[str], str] | None:
        """The next queued texts for one stream, joined (lock held); None
        once the writer is to end."""
        while not self._queue:
            if self._writer is not threading.current_thread():
                return None
            self._cond.wait()
        stream, text = self._queue.popleft()
        parts = [text]
        while self._queue and self._queue[0][0] is stream:
            parts.append(self._queue.popleft()[1])
        return stream, "".join(parts)

    def _write_queued(self) -> None:
        while True:
            with self._lock:
                taken = self._take()
                if taken is None:
                    return
                self._busy = True
            stream, text = taken
            try:
                _write_text(stream, text)
            except Exception:  # noqa: BLE001 - a closed pipe or file: it takes nothing more
                with self._lock:
                    self._broken.add(id(stream))
                    dropped = sum(len(t) for s, t in self._queue if s is stream)
                    self._queue = collections.deque(q for q in self._queue if q[0] is not stream)
                    self.backlog -= dropped
            finally:
                with self._lock:
                    self._busy = False
                    self.backlog -= len(text)
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
                self._put(self.err, _CLEAR)
                self._shown = False
            took = time.monotonic() - progress.began
            self._put(self.err, f"dsrun: {progress.text()} in {took:.1f}s\n")

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
            self._put(self.err, f"dsrun: {progress.text()}\n")

    def _redraw(self) -> None:
        if self.tty and self._progress is not None:
            self._put(self.err, f"{_CLEAR}dsrun: {self._progress.text()}")
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


def _isatty(stream: IO[str]) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False
