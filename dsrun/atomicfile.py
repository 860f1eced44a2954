"""Replacing a file atomically, through symlinks (torch-free: the launcher's
hostfile editor and the checkpoint consolidation both use it).

:class:`AtomicFile` opens a temporary file of its own (``mkstemp``,
``.NAME.XXXX.tmp``) beside the file ``path`` names, after following
symlinks, so a user's ``NAME.tmp`` is never touched and a symlinked output
is written through. :meth:`AtomicFile.finish` syncs it, gives it the old
file's mode (a new file the umask default), renames it over the target and
syncs the directory: readers see the old file or the new one, never a part.
:meth:`AtomicFile.abort` removes only the temporary file.
"""

from __future__ import annotations

import contextlib
import os
import stat
import tempfile
from typing import BinaryIO

__all__ = ["AtomicFile", "fsync_dir"]


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _current_umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


class AtomicFile:
    """A temporary file that :meth:`finish` renames over ``path`` (module
    docstring); raises ``OSError`` when it cannot be created."""

    def __init__(self, path: str) -> None:
        self.target = os.path.realpath(path)
        try:
            self.mode = stat.S_IMODE(os.stat(self.target).st_mode)
        except FileNotFoundError:
            self.mode = 0o666 & ~_current_umask()
        directory, name = os.path.split(self.target)
        fd, self.tmp = tempfile.mkstemp(prefix=f".{name}.", suffix=".tmp", dir=directory)
        self.file: BinaryIO = os.fdopen(fd, "wb")

    def finish(self) -> None:
        try:
            self.file.flush()
            os.fsync(self.file.fileno())
            self.file.close()
            os.chmod(self.tmp, self.mode)
            os.replace(self.tmp, self.target)
        except BaseException:
            self.abort()
            raise
        fsync_dir(os.path.dirname(self.target))

    def abort(self) -> None:
        with contextlib.suppress(OSError):
            self.file.close()
        with contextlib.suppress(OSError):
            os.unlink(self.tmp)
