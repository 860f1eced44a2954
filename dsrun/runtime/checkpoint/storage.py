"""File I/O of checkpoints: durable writes, checked reads, atomic renames.

* Writes go through :func:`write_all` (one ``os.write`` loop: the single
  place a test fakes a full disk), are fsynced, and a full disk or quota
  becomes one :class:`~dsrun.errors.CheckpointError` naming the file and
  what to do. :class:`DataFile` computes each buffer's crc32 in a helper
  thread while the next one is written (both release the GIL), and asks the
  kernel to start writing back every 64 MiB written (Linux
  ``sync_file_range``), so the final fsync finds little left to do.
  ``durable=False`` (``"checkpoint": {"fsync": false}``) skips every fsync:
  a process that dies still leaves complete files behind (the kernel has
  them), an OS crash or power cut may not.
* Small files (records, manifest, ``latest``) are written whole into a
  temporary name, fsynced, renamed over the target, and the directory is
  fsynced (:func:`atomic_write`): a reader sees the old file or the new one.
* Reads (:func:`read_into`) fill a buffer at an offset with ``preadv``,
  naming the file when it is missing or shorter than the manifest says.
* Tensors are written and read as their raw bytes (:func:`tensor_bytes`,
  zero-copy for contiguous CPU tensors): the byte order is the machine's,
  little-endian on every platform torch supports.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import logging
import os
import shutil
import zlib
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Optional

import torch

from dsrun.atomicfile import fsync_dir
from dsrun.errors import CheckpointError
from dsrun.runtime.checkpoint.info import size_texts

log = logging.getLogger("dsrun.runtime.checkpoint")

DISK_FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
WRITE_BLOCK = 64 << 20  # bytes per os.write call
WRITEBACK_EVERY = 64 << 20  # bytes written between early writeback requests
SYNC_FILE_RANGE_WRITE = 2


def _sync_file_range() -> Optional[Callable[..., int]]:
    try:
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_longlong, ctypes.c_longlong, ctypes.c_uint]
    return fn


_SYNC_FILE_RANGE = _sync_file_range()


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def torch_dtype(name: str) -> torch.dtype:
    value = getattr(torch, name, None)
    if not isinstance(value, torch.dtype):
        raise CheckpointError(f"dtype {name!r} is not known to this torch")
    return value


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """The raw bytes of a contiguous CPU tensor (a view, no copy)."""
    if tensor.device.type != "cpu":
        tensor = tensor.cpu()
    flat = tensor.detach().contiguous().reshape(-1)
    if flat.numel() == 0:
        return memoryview(b"")
    return memoryview(flat.view(torch.uint8).numpy()).cast("B")


def _file_size_limit() -> Optional[int]:
    """This process's file-size limit in bytes (``ulimit -f``), None when unlimited."""
    try:
        import resource
    except ImportError:  # not on this platform
        return None
    soft = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    return None if soft == resource.RLIM_INFINITY else soft


def disk_full_error(path: str, exc: OSError, written: int, total: int,
                    whose: Optional[str] = "this rank's", note: str = "") -> CheckpointError:
    """The error for a write that ran out of room (an errno of
    :data:`DISK_FULL`): what ran out - the device's space, the quota, or the
    largest size a file may have (EFBIG, where freeing space does not help) -,
    how much of the file was written, and what to do. ``whose`` qualifies the
    file's bytes ("this rank's" data; None for a small file of the save's
    own); ``note`` is appended (what the failure leaves intact)."""
    done, whole = size_texts(written, total)
    of = f"{whose} " if whose else ""
    progress = (f"all {whole} of {of}data were written, flushing them failed"
                if written >= total else
                f"{done} of {of}{whole} were written before the write failed")
    cause = os.strerror(exc.errno or 0)
    if exc.errno == errno.EFBIG:
        # the limit refuses a write only at or past it: below it, the file system did
        limit = _file_size_limit()
        if limit is not None and written >= limit:
            which = (f"this process may not write files larger than {size_texts(limit)[0]} "
                     f"(ulimit -f, RLIMIT_FSIZE {limit:,} bytes)")
            fix = "raise the limit"
        else:
            which = "the file system refused a file that large"
            fix = "save to a file system that allows larger files"
        text = (f"the file-size limit was reached writing {path} ({cause}; {progress}): "
                f"{which}; freeing space will not help: {fix}")
    else:
        what = "the disk quota is exhausted" if exc.errno == errno.EDQUOT \
            else "no space left on the device"
        text = (f"{what} writing {path} ({cause}; {progress}): free space or save to another "
                "directory")
    return CheckpointError(f"{text}; {note}" if note else text)


class WriteFailed(OSError):
    """An ``OSError`` of :func:`write_all` that knows how many bytes went
    out before it (``done``)."""

    def __init__(self, exc: OSError, done: int) -> None:
        super().__init__(exc.errno, exc.strerror)
        self.done = done


def write_all(fd: int, data: memoryview) -> None:
    """Write every byte of ``data`` to ``fd``; a failure says how many
    were written before it (:class:`WriteFailed`)."""
    view = data
    try:
        while len(view):
            done = os.write(fd, view[:WRITE_BLOCK])
            view = view[done:]
    except OSError as exc:
        raise WriteFailed(exc, len(data) - len(view)) from exc


class DataFile:
    """Append raw buffers to one file; crc32 of each; fsync on close."""

    def __init__(self, path: str, total: int, durable: bool = True,
                 whose: Optional[str] = "this rank's", note: str = "") -> None:
        self.path = path
        self.total = total
        self.durable = durable
        self.whose, self.note = whose, note  # for disk_full_error
        self.written = 0
        self._flushed = 0
        self._crcs: list[Future] = []
        self._pool: Optional[ThreadPoolExecutor] = None
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)

    def append(self, data: memoryview) -> None:
        """Write ``data`` (its crc32 is computed meanwhile: :meth:`close`)."""
        if self._pool is None and len(data) > (1 << 20):
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="dsrun-crc")
        if self._pool is not None:
            self._crcs.append(self._pool.submit(zlib.crc32, data))
        else:
            done: Future = Future()
            done.set_result(zlib.crc32(data))
            self._crcs.append(done)
        try:
            write_all(self.fd, data)
        except WriteFailed as exc:
            self.written += exc.done
            raise self._error(exc) from None
        self.written += len(data)
        if self.durable and _SYNC_FILE_RANGE is not None and \
                self.written - self._flushed >= WRITEBACK_EVERY:
            _SYNC_FILE_RANGE(self.fd, self._flushed, self.written - self._flushed,
                             SYNC_FILE_RANGE_WRITE)
            self._flushed = self.written

    def _error(self, exc: OSError, flushing: bool = False) -> CheckpointError:
        if exc.errno in DISK_FULL:  # flushing: every byte was written, the fsync failed
            return disk_full_error(self.path, exc, self.written,
                                   self.written if flushing else self.total, self.whose, self.note)
        text = f"writing {self.path} failed: {exc}"
        return CheckpointError(f"{text}; {self.note}" if self.note else text)

    def close(self) -> list[int]:
        """fsync and close; the crc32 of every buffer appended, in order."""
        try:
            if self.durable:
                os.fsync(self.fd)
        except OSError as exc:
            raise self._error(exc, flushing=True) from None
        finally:
            self._release()
        return [f.result() for f in self._crcs]

    def _release(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        if self._pool is not None:
            self._pool.shutdown(wait=True)

    def __enter__(self) -> DataFile:
        return self

    def __exit__(self, *exc: Any) -> None:
        if exc[0] is not None:
            self._release()


def atomic_write(path: str, data: bytes, sync_dir: bool = True, durable: bool = True,
                 note: str = "") -> None:
    """Replace ``path`` with ``data``: temporary file, fsync, rename, and
    fsync the directory (``sync_dir`` False: the caller fsyncs it later;
    ``durable`` False: no fsync at all). ``note``: appended to a write
    error (:class:`DataFile`)."""
    tmp = f"{path}.tmp.{os.getpid()}"
    try:
        with DataFile(tmp, len(data), durable, None, note) as out:
            out.append(memoryview(data))
            out.close()
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    if sync_dir and durable:
        fsync_dir(os.path.dirname(os.path.abspath(path)))


def read_file(path: str, what: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except FileNotFoundError:
        raise CheckpointError(f"{what} {path} is missing") from None
    except OSError as exc:
        raise CheckpointError(f"cannot read {what} {path}: {exc}") from None


def read_into(fd: int, path: str, offset: int, buffer: memoryview) -> None:
    """Fill ``buffer`` from ``offset`` of the open file ``path``."""
    view = buffer
    position = offset
    while len(view):
        got = os.preadv(fd, [view], position)
        if got == 0:
            raise CheckpointError(f"{path} is truncated: it ends at byte {position}, the "
                                  f"manifest needs {offset + len(buffer)}")
        view = view[got:]
        position += got


def remove_tree(path: str) -> None:
    """Remove a directory tree, logging (not raising) what cannot go."""
    if os.path.isdir(path):
        shutil.rmtree(path, onerror=_not_removed)


def _not_removed(_function: Any, path: str, exc_info: Any) -> None:
    if not isinstance(exc_info[1], FileNotFoundError):  # another process removed it first
        log.warning("cannot remove %s: %s", path, exc_info[1])


def free_bytes(path: str) -> int:
    stats = os.statvfs(path)
    return stats.f_bavail * stats.f_frsize
