"""What a launch tool (mpirun, srun) printed, reduced to why it failed.

Split from connect.py, which feeds :class:`ToolOutput` every line of the
tool's stdout and stderr and names :meth:`ToolOutput.summary` in its errors.
"""

from __future__ import annotations

import collections

#: Lines of the tool's output kept for its failure message.
TOOL_TAIL = 20
#: srun's line when a signal of its own (SIGTERM, a second Ctrl-C) made it
#: kill every task of its step at once: the agents' connections then drop
#: while srun still waits for its step's end.
FORCED = "forcing job termination"


# words of a launch tool's line that says what went wrong
_TELLING = ("error", "unrecognized", "unrecognised", "invalid", "could not", "cannot",
            "can't", "not found", "no such", "denied", "refused", "failed", "unknown",
            "unable")


#: A rule framing an Open MPI message box (show_help prints one above and below).
_BOX_RULE = "-" * 20
#: Characters of a box's opening sentence quoted in a summary.
BOX_QUOTE = 300


class ToolOutput:
    """A launch tool's output, reduced to the line that best says why it
    failed (pure): the first line naming a problem - tools say the cause
    before their summary ("ssh: Could not resolve hostname" before Open
    MPI's "was unable to reliably start one or more daemons"), and it is
    kept however much output follows - else the opening paragraph of the
    last message box Open MPI printed (between rules of dashes: "There are
    not enough slots available in the system to satisfy the 4 slots that
    were requested by the application:", not the box's last word), else the
    last of the kept tail that is neither a rule of dashes or equals signs
    nor a "Try --help" pointer. Stderr's wins over stdout's at each step:
    the two pipes are read apart (each by its own thread, so the state is
    kept per pipe), their order is not known, and the cause goes to stderr."""

    def __init__(self, keep: int = TOOL_TAIL) -> None:
        self.first_telling: dict[int, str] = {}  # by fd
        self.forced: str | None = None  # the tool's FORCED line, once it said it
        self.tail: collections.deque[str] = collections.deque(maxlen=keep)
        self.last_box: dict[int, str] = {}  # by fd: the opening paragraph
        self._inside: dict[int, bool] = {}  # by fd: between a box's rules
        self._para: dict[int, list[str] | None] = {}  # by fd: None once taken

    def add(self, line: str, fd: int = 2) -> None:
        stripped = line.strip()
        self._box_line(stripped, fd)
        if not stripped or _filler(stripped):
            return
        self.tail.append(stripped)
        if self.forced is None and FORCED in stripped.lower():
            self.forced = stripped
        if fd not in self.first_telling and any(w in stripped.lower() for w in _TELLING):
            self.first_telling[fd] = stripped

    def _box_line(self, stripped: str, fd: int) -> None:
        """Follow Open MPI's boxes: a rule opens one, the next closes it; the
        box's first paragraph ends at a blank line or at the closing rule."""
        para = self._para.get(fd)
        if stripped.startswith(_BOX_RULE) and not stripped.strip("-"):
            if self._inside.get(fd):
                if para:
                    self._keep_box(fd, para)
                self._inside[fd] = False
            else:
                self._inside[fd] = True
                self._para[fd] = []
        elif self._inside.get(fd) and para is not None:
            if stripped:
                if sum(map(len, para)) <= BOX_QUOTE:  # the quote's length is all it needs
                    para.append(stripped)
            elif para:  # blank lines before the text are no paragraph's end
                self._keep_box(fd, para)

    def _keep_box(self, fd: int, para: list[str]) -> None:
        text = " ".join(para)
        self.last_box[fd] = text if len(text) <= BOX_QUOTE else text[:BOX_QUOTE - 3] + "..."
        self._para[fd] = None

    def summary(self) -> str:
        telling = self.first_telling.get(2) or self.first_telling.get(1)
        box = self.last_box.get(2) or self.last_box.get(1)
        return telling or box or (self.tail[-1] if self.tail else "")


def _filler(line: str) -> bool:
    if not any(ch.isalnum() for ch in line):
        return True  # "-----", "=====", "***"
    lower = line.lower()
    return lower.startswith("try ") and "--help" in lower
