"""A node agent's channel to its launcher: one reader and one writer thread.

The channel is the agent's stdin/stdout (a local child, an SSH exec
channel) or a TCP connection the agent opened back to the launcher
(mpirun/srun). Protocol: protocol.py. Invariants:

- nothing the agent's supervision loop does ever blocks on the channel:
  :meth:`Link.send` queues, and the writer thread writes. Rank output
  waits while :data:`OUTPUT_BACKLOG` bytes of it are queued (the
  back-pressure a direct write would give: the ranks' pumps stop reading,
  the ranks block in their writes); control events (exits, ``done``,
  heartbeats, stacks) never wait and go out before queued output;
- output flow control: after the launcher's ``pause`` command no rank
  output is written (control events still are) until ``resume``; the
  launcher pauses its agents while its own console cannot keep up, so a
  slow reader of dsrun's stdout slows the ranks instead of filling the
  launcher's memory. :meth:`Link.drain` (the agent's last act) writes
  what is queued even when paused;
- the writer sends queued output in batches, one write and one flush each;
- the reader thread splits the input into messages; heartbeats
  (``{"cmd": "hb", "timeout": T}``) only refresh :attr:`Link.heard` and set
  the heartbeat timeout, every other message goes to :meth:`Link.get`;
- the writer sends ``{"ev": "hb"}`` whenever nothing else went out for a
  quarter of the heartbeat timeout, for as long as the agent lives -
  during a long teardown too;
- :meth:`Link.lost`: nothing heard for longer than the heartbeat timeout
  (the launcher died, or its host or the network between went silent: a
  dead link stalls instead of closing). Before the first heartbeat the
  limit is :data:`FIRST_CONTACT`. Once lost, or once the channel is closed,
  output is dropped: nobody can read it.
"""

from __future__ import annotations

import collections
import os
import queue
import threading
import time
from typing import IO, TYPE_CHECKING, Any

from dsrun.launcher import protocol

if TYPE_CHECKING:
    import socket

#: Bytes of rank output queued before the ranks' pumps wait.
OUTPUT_BACKLOG = 4 * 1024 * 1024
#: The most bytes of queued output written in one go.
WRITE_BATCH = 256 * 1024
#: Seconds to hear the launcher's first heartbeat before giving up on it.
FIRST_CONTACT = 120.0
#: What :meth:`Link.get` returns once the input has ended.
END = None
EMPTY: dict[str, Any] = {}
_HEARTBEAT = protocol.encode({"ev": "hb"})


class Link:
    """Raw reads from ``fd``, JSON lines to ``out``; see the module docstring."""

    def __init__(self, fd: int, out: IO[bytes], sock: socket.socket | None = None) -> None:
        self.fd = fd
        self.out = out
        self.sock = sock  # held: the fd is the socket's for as long as the agent runs
        self.heard = time.monotonic()
        self.timeout = FIRST_CONTACT
        self.told = False  # the launcher has said its heartbeat timeout
        self.closed = False  # the launcher's end is gone (read or write failed)
        self._inbox: queue.Queue[dict[str, Any] | None] = queue.Queue()
        self._cond = threading.Condition()
        self._control: collections.deque[bytes] = collections.deque()
        self._output: collections.deque[bytes] = collections.deque()
        self._output_bytes = 0
        self.paused = False  # the launcher's ``pause``: hold rank output
        self._draining = False  # drain(): write output even when paused
        self._writing = False
        self._reader = threading.Thread(target=self._read, daemon=True, name="dsrun-link-in")
        self._writer = threading.Thread(target=self._write, daemon=True, name="dsrun-link-out")

    def start(self) -> Link:
        self._reader.start()
        self._writer.start()
        return self

    # -- input ----------------------------------------------------------------
    def _read(self) -> None:
        pending = b""
        while True:
            try:
                chunk = os.read(self.fd, 65536)
            except OSError:
                chunk = b""
            if not chunk:
                break
            self.heard = time.monotonic()
            pending += chunk
            *lines, pending = pending.split(b"\n")
            for line in lines:
                self._take(line)
        if pending.strip():
            self._take(pending)
        with self._cond:
            self.closed = True
            self._cond.notify_all()
        self._inbox.put(END)

    def _take(self, line: bytes) -> None:
        if not line.strip():
            self._inbox.put(EMPTY)  # an empty line: a broken launcher
            return
        try:
            msg = protocol.decode(line)
        except ValueError:
            return
        if msg.get("cmd") == "hb":
            with self._cond:
                self.timeout = float(msg.get("timeout") or 0)
                self.told = True
                self._cond.notify_all()  # the writer's heartbeat period may change
            return
        self._inbox.put(msg)

    def pause_output(self, paused: bool) -> None:
        """The launcher's ``pause`` / ``resume`` (see the module docstring)."""
        with self._cond:
            self.paused = paused
            self._cond.notify_all()

    def get(self, timeout: float | None) -> dict[str, Any] | None:
        """The next message; :data:`END` at end of input; raises queue.Empty."""
        return self._inbox.get(timeout=timeout)

    def silent_for(self) -> float:
        return time.monotonic() - self.heard

    def lost(self) -> bool:
        """No sign of the launcher for longer than the heartbeat timeout."""
        return self.timeout > 0 and self.silent_for() > self.timeout

    # -- output ---------------------------------------------------------------
    def send(self, obj: dict[str, Any], control: bool = True) -> None:
        """Queue ``obj`` for the launcher (see the module docstring)."""
        data = protocol.encode(obj)
        with self._cond:
            if not control:
                while self._output_bytes >= OUTPUT_BACKLOG and not self._gone():
                    self._cond.wait(0.5)
            if self._gone():
                return
            if control:
                self._control.append(data)
            else:
                self._output.append(data)
                self._output_bytes += len(data)
            self._cond.notify_all()

    def _output_ready(self) -> bool:
        return bool(self._output) and (not self.paused or self._draining)

    def _take_output(self) -> bytes:
        """Queued output up to WRITE_BATCH bytes (at least one message)."""
        parts, size = [], 0
        while self._output and (not parts or size + len(self._output[0]) <= WRITE_BATCH):
            part = self._output.popleft()
            parts.append(part)
            size += len(part)
        self._output_bytes -= size
        return b"".join(parts)

    def _gone(self) -> bool:
        return self.closed or self.lost()

    def _beat_due(self, last_write: float) -> float | None:
        """Seconds until a heartbeat is due (<= 0: now); None: none wanted."""
        if not self.timeout or not self.told:
            return None  # heartbeats off, or the launcher has not asked yet
        return last_write + self.timeout / 4 - time.monotonic()

    def _write(self) -> None:
        last_write = time.monotonic()
        while True:
            with self._cond:
                data = b""
                while not self._control and not self._output_ready():
                    due = self._beat_due(last_write)
                    if due is not None and due <= 0 and not self._gone():
                        data = _HEARTBEAT
                        break
                    self._cond.wait(due)
                if not data:
                    if self._control:
                        data = b"".join(self._control)
                        self._control.clear()
                    else:
                        data = self._take_output()
                self._writing = True
                self._cond.notify_all()
            try:
                self.out.write(data)
                self.out.flush()
            except (OSError, ValueError):
                with self._cond:
                    self.closed = True
                    self._control.clear()
                    self._output.clear()
                    self._output_bytes = 0
            finally:
                last_write = time.monotonic()
                with self._cond:
                    self._writing = False
                    self._cond.notify_all()

    def drain(self, timeout: float | None) -> bool:
        """Wait until everything queued is written (``timeout`` None: or the
        link is gone or lost); False if that did not happen."""
        end = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            self._draining = True
            self._cond.notify_all()
            while (self._control or self._output or self._writing) and not self._gone():
                left = 1.0 if end is None else end - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
            return not (self._control or self._output or self._writing)
