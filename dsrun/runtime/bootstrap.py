"""The injected runtime: what every rank runs before the user's script.

``python -m dsrun.runtime.bootstrap --script PATH ARGS...`` (or
``--module NAME ARGS...``):

1. arms the parent-death signal (the rank dies with its node agent;
   deathsig.py) and the stack handler (``dsrun stack``; stackdump.py), and
   binds the rank to its CPUs under ``--bind_cores_to_rank`` (before torch
   starts a thread);
2. reads the DistEnv and initialises torch.distributed (unless the backend
   is ``none``);
3. runs the script as ``__main__`` with the ``sys.argv`` and ``sys.path[0]``
   that ``python PATH ARGS...`` would give it (``python -m NAME`` for
   ``--module``); an argparse parser that declares ``--local_rank`` gets it
   filled in (localrank.py). The working directory that ``-m`` put first on
   sys.path is dropped before the bootstrap's own imports, so a json.py
   there cannot stand in for the stdlib's;
4. at exit tells the other ranks it has left (exitmark.py: a checkpoint
   call waiting for it fails at once), destroys the process group and
   leaves quickly without losing buffered file data (fastexit.py).

An uncaught exception is recorded as JSON (rank, host, time, traceback) in
``DSRUN_ERROR_FILE`` for the agent's root-cause report - no decorator
needed in user code - and printed as Python would, without the bootstrap's
own frames. A :class:`~dsrun.errors.DsrunError` (a bad config, a bad
argument to dsrun's API) is one message and the line of the script that
called dsrun, without dsrun's frames; under an agent it is only recorded,
so the launcher's report shows it once for the whole job. A child the
script forks (``os.fork()``) that leaves through Python ends as
multiprocessing's fork children do: no teardown of the inherited process
group (it would wait forever for the parent's threads) and no error record
(its error is not the rank's). A Ctrl-C that
lands before the script starts ends the rank with Python's 130 and no
traceback of dsrun's imports or rendezvous (the launcher reports the stop).
"""

from __future__ import annotations

import os
import sys

from dsrun.safepath import drop_cwd_entry

# Before any other import (safepath.py). The user's code gets Python's own
# sys.path[0] back (_run_target); --module needs the entry dropped here.
if __name__ == "__main__":
    _CWD_ENTRY = drop_cwd_entry()
else:
    _CWD_ENTRY = None

import builtins
import importlib.machinery
import importlib.util
import io
import json
import marshal
import runpy
import signal
import socket
import time
import traceback
import types
import zipfile
import zipimport
from types import TracebackType

import dsrun
from dsrun import deathsig, stackdump
from dsrun.errors import DsrunError
from dsrun.runtime import exitmark
from dsrun.runtime.env import DistEnv
from dsrun.runtime.fastexit import fast_exit

_OWN_FILES = (os.path.abspath(__file__), runpy.__file__)
#: The rank's own pid. A child the script made with os.fork() runs this
#: module's exit path too; it is not the rank (module docstring).
_RANK_PID = os.getpid()


def forked_child() -> bool:
    """Whether this process is a child the script forked, not the rank."""
    return os.getpid() != _RANK_PID
_PACKAGE_DIR = os.path.dirname(os.path.abspath(dsrun.__file__)) + os.sep


def _user_traceback(exc: BaseException) -> str:
    """Format ``exc`` without the frames of the bootstrap and runpy."""
    tb: TracebackType | None = exc.__traceback__
    while tb is not None and _is_own_frame(tb.tb_frame.f_code.co_filename):
        tb = tb.tb_next
    return "".join(traceback.format_exception(type(exc), exc, tb))


def _is_own_frame(filename: str) -> bool:
    return filename.startswith("<frozen runpy") or os.path.abspath(filename) in _OWN_FILES


def dsrun_call_site(exc: BaseException) -> str | None:
    """``file:line in function`` of the script's call into dsrun that raised
    ``exc``: the last frame before the first frame inside the dsrun package."""
    site = None
    for frame, line in traceback.walk_tb(exc.__traceback__):
        filename = os.path.abspath(frame.f_code.co_filename)
        if _is_own_frame(frame.f_code.co_filename):
            continue
        if filename.startswith(_PACKAGE_DIR):
            break
        site = f"{frame.f_code.co_filename}:{line} in {frame.f_code.co_name}"
    return site


def record_error(env: DistEnv, exc: BaseException, text: str,
                 message: str | None = None, exit_code: int = 1,
                 where: str | None = None) -> bool:
    """Write the rank's error record for its agent; False when there is none
    (a forked child's error is its own, printed but not the rank's)."""
    if not env.error_file or forked_child():
        return False
    now = time.time()
    record = {
        "rank": env.rank, "local_rank": env.local_rank, "host": socket.gethostname(),
        "pid": os.getpid(), "time": now,
        "time_str": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(now)),
        "exc_type": type(exc).__name__, "message": message or str(exc), "traceback": text,
        "exit_code": exit_code, "where": where,
    }
    tmp = env.error_file + ".tmp"
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(record, f)
        os.replace(tmp, env.error_file)
    except OSError:
        return False  # the report loses the traceback, the exit code still tells
    return True


def report_dsrun_error(env: DistEnv, exc: DsrunError) -> None:
    """One message and the script's call site; printed here only when no
    agent collects it (the launcher's report prints it once per job)."""
    message = f"{type(exc).__name__}: {exc}"
    where = dsrun_call_site(exc)
    if not record_error(env, exc, "", message=message, exit_code=exc.exit_code or 1,
                        where=where):
        sys.stderr.write(f"dsrun: error: {message}\n" + (f"  at {where}\n" if where else ""))
        sys.stderr.flush()


#: Set when the user's code starts: a Ctrl-C before that interrupted only
#: dsrun's own setup (imports, rendezvous), which the user has no use for a
#: traceback of.
_target_started = False


def _run_target(mode: str, target: str, args: list[str]) -> None:
    global _target_started
    sys.argv = [target, *args]
    _target_started = True
    if mode == "--module":
        if _CWD_ENTRY is not None:  # as ``python -m``: the working directory first
            sys.path.insert(0, _CWD_ENTRY)
        runpy.run_module(target, run_name="__main__", alter_sys=True)
        return
    run_script(target)


def run_script(target: str) -> None:
    """Run ``target`` as ``python target`` does (3.9+): ``__file__`` and the
    code's file name absolute (tracebacks too), ``sys.argv[0]`` as given;
    ``sys.path[0]`` the script's real directory, or the directory or zip
    file itself when that holds the ``__main__.py``. (runpy.run_path would
    also set ``sys.argv[0]`` to the path it is given.)"""
    path = os.path.abspath(target)
    if not os.path.isdir(path) and zipfile.is_zipfile(path):
        _set_path0(path)
        importer = zipimport.zipimporter(path)
        _exec_main(importer.get_code("__main__"), importer.get_filename("__main__"), importer)
        return
    if os.path.isdir(path):
        _set_path0(path)
        path = os.path.join(path, "__main__.py")
    else:
        _set_path0(os.path.dirname(os.path.realpath(path)))
    with io.open_code(path) as f:
        data = f.read()
    if data[:4] == importlib.util.MAGIC_NUMBER:  # a .pyc file: 16 bytes of header
        code = marshal.loads(data[16:])
    else:
        code = compile(data, path, "exec", dont_inherit=True)
    _exec_main(code, path, importlib.machinery.SourceFileLoader("__main__", path))


def _set_path0(entry: str) -> None:
    """Put the script's ``entry`` first on sys.path, as ``python PATH`` does
    (not under PYTHONSAFEPATH); the entries after it stay (the working
    directory is no longer first: dsrun/safepath.py)."""
    if not getattr(sys.flags, "safe_path", False):
        sys.path.insert(0, entry)


def _exec_main(code: types.CodeType, filename: str, loader: object) -> None:
    """Run ``code`` as the ``__main__`` module (which pickle and
    multiprocessing look up in sys.modules)."""
    module = types.ModuleType("__main__")
    module.__dict__.update(__file__=filename, __loader__=loader, __builtins__=builtins,
                           __cached__=None, __spec__=None, __package__=None)
    sys.modules["__main__"] = module
    exec(code, module.__dict__)


def _mpi_size() -> int:
    from dsrun.runtime.rendezvous import mpi_comm

    return int(mpi_comm().Get_size())


def _prepare_process() -> DistEnv:
    """What must happen before anything slow: die with the agent, answer
    stack requests, know where this rank sits."""
    deathsig.die_with_parent(deathsig.agent_pid(os.environ))
    env = DistEnv.detect(mpi_size=_mpi_size)
    stackdump.install(env.stack_file)
    if env.fill_local_rank:
        from dsrun.runtime import localrank

        localrank.install(env.local_rank)
    return env


def main() -> int:
    if len(sys.argv) < 3 or sys.argv[1] not in ("--script", "--module"):
        sys.stderr.write("usage: python -m dsrun.runtime.bootstrap --script|--module TARGET ...\n")
        return 2
    mode, target, args = sys.argv[1], sys.argv[2], sys.argv[3:]
    env = _prepare_process()
    dist_on = env.backend != "none"
    status, left_by = 0, None  # how the rank leaves: its peers are told (exitmark.py)
    try:
        unbound = deathsig.bind_cpus(os.environ)  # before torch starts any thread
        if unbound:
            raise DsrunError(unbound)
        if dist_on:
            from dsrun.runtime import dist

            dist.init_distributed(env=env)
            dist.install_compat()
        _run_target(mode, target, args)
    except DsrunError as exc:
        status, left_by = exc.exit_code or 1, exc
        report_dsrun_error(env, exc)
        return status
    except SystemExit as exc:
        status, left_by = exit_status(exc), exc
        if exc.code not in (None, 0):  # stamp the time: it may be the first failure
            record_error(env, exc, "", message=f"the script called sys.exit({exc.code!r})",
                         exit_code=exc.code if isinstance(exc.code, int) else 1)
        raise
    except BaseException as exc:  # noqa: BLE001 - every uncaught error is reported
        # Python exits 130 (128 + SIGINT) after an uncaught KeyboardInterrupt.
        code = 128 + signal.SIGINT if isinstance(exc, KeyboardInterrupt) else 1
        status, left_by = code, exc
        if code != 1 and not _target_started:
            # The job was Ctrl-C'd while this rank was still setting up
            # (imports, rendezvous): the launcher says so once for the job.
            return code
        text = _user_traceback(exc)
        record_error(env, exc, text, exit_code=code)
        sys.stderr.write(text)
        sys.stderr.flush()
        return code
    finally:
        # A forked child holds a copy of the parent's group without its
        # threads: destroying it there waits forever (torch's teardown too).
        if dist_on and "dsrun.runtime.dist" in sys.modules and not forked_child():
            if env.world_size > 1:  # before the group goes: peers may wait for this rank
                exitmark.mark_exited(env.rank, status, left_by)
            sys.modules["dsrun.runtime.dist"].shutdown()
    return 0


def exit_status(exc: SystemExit) -> int:
    """The status ``sys.exit(exc.code)`` ends Python with (pure)."""
    if exc.code is None or isinstance(exc.code, int):
        return exc.code or 0
    return 1


def _exit_code(exc: SystemExit) -> int:
    """The status ``sys.exit(exc.code)`` ends Python with (a message: 1,
    after printing it to stderr as Python does)."""
    if exc.code is None or isinstance(exc.code, int):
        return exc.code or 0
    sys.stderr.write(f"{exc.code}\n")
    return 1


if __name__ == "__main__":
    try:
        rc = main()
    except SystemExit as exc:
        if forked_child():  # never the interpreter's teardown (fast_exit)
            fast_exit(_exit_code(exc), forked=True)
        if exc.code is None or isinstance(exc.code, int):
            fast_exit(exc.code or 0)
        raise
    fast_exit(rc, forked=forked_child())
    sys.exit(rc)
