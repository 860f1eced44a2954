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
"""

from __future__ import annotations

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
        self.out = out or sys.stdout
        self.err = err or sys.stderr
        self.tty = _isatty(self.err) if tty is None else tty
        self._lock = threading.RLock()
        self._progress: _Progress | None = None
        self._shown = False  # the progress line is on the terminal now

    # -- plain output -----------------------------------------------------------
    def line(self, host: str, rank: int, fd: int, text: str) -> None:
        """One line of a rank (rank >= 0), an agent or a launching tool."""
        who = f"{host}:{rank}" if rank >= 0 else f"{host}:agent" if rank == AGENT_LINE else host
        self._write(self.out if fd == 1 else self.err, f"[{who}] {text}\n")

    def say(self, message: str) -> None:
        self._write(self.err, f"dsrun: {message}\n")

    def _write(self, stream: IO[str], text: str) -> None:
        with self._lock:
            if self._shown:
                self.err.write(_CLEAR)
                self.err.flush()
                self._shown = False
            stream.write(text)
            stream.flush()
            self._redraw()

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
                self.err.write(_CLEAR)
                self._shown = False
            took = time.monotonic() - progress.began
            self.err.write(f"dsrun: {progress.text()} in {took:.1f}s\n")
            self.err.flush()

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
            self.err.write(f"dsrun: {progress.text()}\n")
            self.err.flush()

    def _redraw(self) -> None:
        if self.tty and self._progress is not None:
            self.err.write(f"{_CLEAR}dsrun: {self._progress.text()}")
            self.err.flush()
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


def _isatty(stream: IO[str]) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False
