"""Ending a rank quickly without losing what plain ``python`` would keep.

With torch loaded, interpreter finalisation takes ~0.5 s per rank. A rank
only needs what a normal exit guarantees to user code, so :func:`fast_exit`
does exactly that and then ``os._exit``:

1. ``atexit`` handlers run (logging, multiprocessing and most libraries
   flush there);
2. every open file object is flushed: plain python closes (and so flushes)
   files the script never closed when it tears the interpreter down, so a
   file written without ``close()`` keeps its buffered tail. Files of the
   io module's own classes are flushed here; an open writable file of any
   other class (``gzip.GzipFile``, ``zipfile``, a library's own stream)
   may need its ``close()`` to be complete, so then the normal exit path
   is taken instead;
3. MPI is finalised when the script used mpi4py (mpi4py finalises from the
   interpreter's teardown, which is skipped; an MPI process that exits
   without it is an abnormal termination to mpirun);
4. the standard streams are flushed.

The normal exit path is also taken when non-daemon threads still run, or
when ``DSRUN_FAST_EXIT=0``.
"""

from __future__ import annotations

import atexit
import gc
import io
import os
import sys
import threading

_IOBASE = io.IOBase.__mro__[1]  # _io._IOBase, the C class every io class derives from
assert _IOBASE.__name__ == "_IOBase"
#: io classes whose flush() writes everything close() would.
_PLAIN = (io.TextIOWrapper, io.BufferedWriter, io.BufferedRandom, io.FileIO)


def open_files() -> tuple[list[io.IOBase], list[io.IOBase]]:
    """(plain io files to flush, other writable file objects) still open,
    not counting the standard streams."""
    std = {id(s) for s in (sys.stdout, sys.stderr, sys.stdin, sys.__stdout__,
                           sys.__stderr__, sys.__stdin__) if s is not None}
    plain: list[io.IOBase] = []
    other: list[io.IOBase] = []
    for obj in gc.get_objects():
        # The C base of every io class, checked on type(): fast (no ABC
        # machinery) and silent (some objects warn when __class__ is read).
        if not issubclass(type(obj), _IOBASE) or id(obj) in std:
            continue
        try:
            if obj.closed or not obj.writable():
                continue
        except (ValueError, OSError, AttributeError):
            continue
        (plain if isinstance(obj, _PLAIN) else other).append(obj)
    return plain, other


def flush_files(files: list[io.IOBase]) -> None:
    # Text wrappers first: flushing one also flushes the buffer below it.
    for obj in sorted(files, key=lambda f: not isinstance(f, io.TextIOWrapper)):
        try:
            obj.flush()
        except (OSError, ValueError):
            pass  # a full disk: plain python would lose it the same way


def fast_exit(code: int, forked: bool = False) -> None:
    """Exit now if that is safe (see the module docstring); else return.
    ``forked``: a child the rank forked, which always exits here: the
    interpreter's teardown would destroy the process group it inherited
    without the parent's threads, and wait forever."""
    if not forked and os.environ.get("DSRUN_FAST_EXIT", "1") == "0":
        return
    others = [t for t in threading.enumerate()
              if t is not threading.main_thread() and t.is_alive() and not t.daemon]
    if others and not forked:
        return
    for thread in others:  # a forked child's own threads: Python waits for them too
        thread.join()
    atexit._run_exitfuncs()
    plain, other = open_files()
    if other and not forked:
        return  # their close() may write more than flush(): exit the normal way
    flush_files(plain)
    if not forked:  # MPI belongs to the rank, not to a process it forked
        finalize_mpi()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError, AttributeError):
            pass
    os._exit(code)


def finalize_mpi() -> None:
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is None:
        return
    rc = getattr(sys.modules.get("mpi4py"), "rc", None)
    try:
        if getattr(rc, "finalize", None) is not False and mpi.Is_initialized() \
                and not mpi.Is_finalized():
            mpi.Finalize()
    except Exception:  # noqa: BLE001 - exiting anyway; the exit code still tells
        pass
