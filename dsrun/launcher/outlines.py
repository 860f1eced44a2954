"""A rank's output stream cut into lines for forwarding, and its tail (pure).

The node agent reads each rank's stdout and stderr in chunks and forwards
them line by line (``[host:rank] ...`` on the launcher, one line per line
in ``--log_dir``). Progress bars (tqdm) redraw one line with ``\\r`` and no
newline, so a line is ended by ``\\n`` *or* ``\\r``; text that sits without
either is forwarded as a line of its own once it has waited
:data:`PARTIAL_IDLE` seconds for a line end, counted from its first byte
(a prompt, a progress bar between redraws, dots printed one per step: more
of the same line does not hold it longer), or when it reaches
:data:`LINE_LIMIT` bytes, so a rank never makes the agent hold more than
that per stream. Its continuation is then a line of its own too.

Invariants: every byte is forwarded exactly once, in order; an empty
segment is forwarded only when it is an empty line (``\\n`` right after a
``\\n``), not the rest of ``\\r\\n`` or the newline that ends text already
forwarded; text is decoded as UTF-8 (bad bytes replaced) and never cut
inside a character except at end of stream.

The failure report shows a rank's last lines as a terminal would: a line
redrawn after ``\\r`` replaces the one before it, and text forwarded early
is joined with its continuation (:class:`Tail`).
"""

from __future__ import annotations

import collections
import re
import threading
from typing import NamedTuple

#: The most bytes of one line held before it is forwarded anyway.
LINE_LIMIT = 64 * 1024
#: Seconds text without a line end is held (from its first byte) before it is forwarded.
PARTIAL_IDLE = 0.25

NEWLINE, RETURN, PARTIAL = "\n", "\r", ""
_LINE_END = re.compile(rb"[\r\n]")


class Segment(NamedTuple):
    """A piece of output and what ended it (NEWLINE, RETURN or PARTIAL)."""

    text: str
    end: str
    forward: bool  # whether it is a line of its own to show


def _whole_chars(data: bytes | bytearray) -> int:
    """Length of the longest prefix of ``data`` that does not end inside a
    UTF-8 character."""
    for back in range(1, min(4, len(data)) + 1):
        byte = data[-back]
        if byte & 0xC0 == 0x80:  # a continuation byte: look further back
            continue
        need = 4 if byte >= 0xF0 else 3 if byte >= 0xE0 else 2 if byte >= 0xC0 else 1
        return len(data) - back if back < need else len(data)
    return len(data)


class LineSplitter:
    """Bytes of one stream in, :class:`Segment` s out (see the module doc)."""

    def __init__(self, limit: int = LINE_LIMIT) -> None:
        self.limit = limit
        self.buf = bytearray()
        self.open = False  # the last segment left its line unfinished

    @property
    def pending(self) -> bool:
        """Text is waiting for a line end (forward it after an idle time)."""
        return bool(self.buf)

    def _segment(self, raw: bytes | bytearray, end: str) -> Segment:
        text = bytes(raw).decode("utf-8", "replace")
        forward = bool(text) or (end == NEWLINE and not self.open)
        self.open = end != NEWLINE
        return Segment(text, end, forward)

    def feed(self, data: bytes) -> list[Segment]:
        self.buf += data
        out: list[Segment] = []
        pos = 0
        while True:
            match = _LINE_END.search(self.buf, pos, pos + self.limit + 1)
            if match is not None:
                end = NEWLINE if match.group() == b"\n" else RETURN
                out.append(self._segment(self.buf[pos:match.start()], end))
                pos = match.end()
            elif len(self.buf) - pos > self.limit:  # an overlong line: forward a piece
                size = _whole_chars(self.buf[pos:pos + self.limit]) or self.limit
                out.append(self._segment(self.buf[pos:pos + size], PARTIAL))
                pos += size
            else:
                break
        del self.buf[:pos]
        return out

    def flush(self, final: bool = False) -> list[Segment]:
        """The text without a line end, after an idle time (keeping a
        character cut in half for later) or at end of stream (``final``)."""
        size = len(self.buf) if final else _whole_chars(self.buf)
        if not size:
            return []
        segment = self._segment(self.buf[:size], PARTIAL)
        del self.buf[:size]
        return [segment]


class Tail:
    """The last lines of a rank's output (both streams) as a terminal shows
    them: text after ``\\r`` replaces the line, text forwarded early is
    joined with its continuation."""

    def __init__(self, size: int) -> None:
        # [stream, text, state]; state: "open" (more may follow), "redraw"
        # (after \r: new text replaces it) or "done"
        self.entries: collections.deque[list] = collections.deque(maxlen=size)
        self.lock = threading.Lock()  # a rank's two streams are read by two threads

    def add(self, stream: int, segment: Segment) -> None:
        with self.lock:
            self._add(stream, segment)

    def _add(self, stream: int, segment: Segment) -> None:
        last = self._open_entry(stream)
        if last is None:
            if not segment.forward:
                return
            last = [stream, "", "open"]
            self.entries.append(last)
        if segment.text:
            text = segment.text if last[2] == "redraw" else last[1] + segment.text
            last[1] = text[-LINE_LIMIT:]  # dots printed for hours stay bounded
        if segment.end == NEWLINE:
            last[2] = "done"
        elif segment.end == RETURN:
            last[2] = "redraw"
        elif segment.text:
            last[2] = "open"

    def _open_entry(self, stream: int) -> list | None:
        for entry in reversed(self.entries):
            if entry[0] == stream:
                return entry if entry[2] != "done" else None
        return None

    def lines(self) -> list[str]:
        with self.lock:
            return [entry[1] for entry in self.entries]
