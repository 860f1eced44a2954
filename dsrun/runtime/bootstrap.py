"""The injected runtime: what every rank runs before the user's script.

``python -m dsrun.runtime.bootstrap --script PATH ARGS...`` (or
``--module NAME ARGS...``): reads the DistEnv, initialises torch.distributed
(unless the backend is ``none``), then runs the script as ``__main__`` with
``sys.argv`` and ``sys.path[0]`` exactly as ``python PATH ARGS...`` would
set them. An uncaught exception is recorded as JSON (rank, host, time,
traceback) in ``DSRUN_ERROR_FILE`` for the agent's root-cause report - no
decorator needed in user code - and printed as Python would, without the
bootstrap's own frames. The process group is destroyed at exit.
"""

from __future__ import annotations

import atexit
import json
import os
import runpy
import socket
import sys
import threading
import time
import traceback
from types import TracebackType

from dsrun.runtime.env import DistEnv

_OWN_FILES = (os.path.abspath(__file__), runpy.__file__)


def _user_traceback(exc: BaseException) -> str:
    """Format ``exc`` without the frames of the bootstrap and runpy."""
    tb: TracebackType | None = exc.__traceback__
    while tb is not None and _is_own_frame(tb.tb_frame.f_code.co_filename):
        tb = tb.tb_next
    return "".join(traceback.format_exception(type(exc), exc, tb))


def _is_own_frame(filename: str) -> bool:
    return filename.startswith("<frozen runpy") or os.path.abspath(filename) in _OWN_FILES


def record_error(env: DistEnv, exc: BaseException, text: str,
                 message: str | None = None, exit_code: int = 1) -> None:
    if not env.error_file:
        return
    now = time.time()
    record = {
        "rank": env.rank, "local_rank": env.local_rank, "host": socket.gethostname(),
        "pid": os.getpid(), "time": now,
        "time_str": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(now)),
        "exc_type": type(exc).__name__, "message": message or str(exc), "traceback": text,
        "exit_code": exit_code,
    }
    tmp = env.error_file + ".tmp"
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(record, f)
        os.replace(tmp, env.error_file)
    except OSError:
        pass  # the report loses the traceback, the exit code still tells


def _run_target(mode: str, target: str, args: list[str]) -> None:
    if mode == "--module":
        sys.argv = [target, *args]
        runpy.run_module(target, run_name="__main__", alter_sys=True)
        return
    sys.argv = [target, *args]
    sys.path[0] = os.path.dirname(os.path.realpath(target))
    runpy.run_path(target, run_name="__main__")


def _mpi_size() -> int:
    from dsrun.runtime.rendezvous import mpi_comm

    return int(mpi_comm().Get_size())


def main() -> int:
    if len(sys.argv) < 3 or sys.argv[1] not in ("--script", "--module"):
        sys.stderr.write("usage: python -m dsrun.runtime.bootstrap --script|--module TARGET ...\n")
        return 2
    mode, target, args = sys.argv[1], sys.argv[2], sys.argv[3:]
    env = DistEnv.detect(mpi_size=_mpi_size)
    dist_on = env.backend != "none"
    if dist_on:
        from dsrun.runtime import dist

        dist.init_distributed(env=env)
        dist.install_compat()
    try:
        _run_target(mode, target, args)
    except SystemExit as exc:
        if exc.code not in (None, 0):  # stamp the time: it may be the first failure
            record_error(env, exc, "", message=f"the script called sys.exit({exc.code!r})",
                         exit_code=exc.code if isinstance(exc.code, int) else 1)
        raise
    except BaseException as exc:  # noqa: BLE001 - every uncaught error is reported
        text = _user_traceback(exc)
        record_error(env, exc, text)
        sys.stderr.write(text)
        sys.stderr.flush()
        return 1
    finally:
        if dist_on:
            dist.shutdown()
    return 0


def _fast_exit(code: int) -> None:
    """Exit without tearing the interpreter down, when that is safe.

    With torch loaded, interpreter finalisation takes ~0.5 s per rank; a job
    only needs what a normal exit guarantees to user code: atexit handlers
    run (logging, multiprocessing and most libraries flush there) and the
    standard streams flushed, and MPI finalised when the script used mpi4py
    (mpi4py finalises from the interpreter's teardown, which is skipped
    here; an MPI process that exits without it is an abnormal termination
    to mpirun). If non-daemon threads are still running, or
    DSRUN_FAST_EXIT=0, the normal exit path is taken.
    """
    if os.environ.get("DSRUN_FAST_EXIT", "1") == "0":
        return
    if any(t.is_alive() and not t.daemon for t in threading.enumerate()
           if t is not threading.main_thread()):
        return
    atexit._run_exitfuncs()
    _finalize_mpi()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


def _finalize_mpi() -> None:
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


if __name__ == "__main__":
    try:
        rc = main()
    except SystemExit as exc:
        if exc.code is None or isinstance(exc.code, int):
            _fast_exit(exc.code or 0)
        raise
    _fast_exit(rc)
    sys.exit(rc)
