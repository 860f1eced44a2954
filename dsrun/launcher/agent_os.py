"""What the node agent needs from the operating system: its stop signals,
a private temporary directory, wait statuses, rank error files, the
shared-memory segments DeepSpeed's CPU all-reduce leaves behind, the
ranks' ``--log_dir`` files (locked for the job's lifetime: two jobs never
write one at once), and what to say when a rank cannot be started.

Kept to the standard library: every agent imports it at start-up.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import IO, Any

#: The signals that stop the agent.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
#: Seconds within which the same stop signal again is the same delivery,
#: not a second signal that hurries the stop: under Slurm a time limit or
#: scancel signals every process of the step, and srun passes the one it
#: got on to its tasks (the agents) as well.
REPEAT = 1.0


class Stop(Exception):
    """Raised by the agent's signal handlers."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = int(signum)


def raise_stop(signum: int, frame: object) -> None:
    raise Stop(signum)


def stop_raising(then: Callable[[int], None] | None = None) -> None:
    """From now on the stop signals do not raise Stop: the teardown has
    begun and must run to its end. ``then(signum)`` runs on each one instead."""
    if threading.current_thread() is not threading.main_thread():
        return  # an agent driven by a test's thread: signals are not its own

    def on_signal(signum: int, frame: object) -> None:
        if then is not None:
            then(signum)

    for sig in STOP_SIGNALS:
        signal.signal(sig, on_signal)


def rank_argv(spec: dict[str, Any]) -> list[str]:
    """A rank's argv; ranks without the injected runtime go through the
    parent-death wrapper (deathsig.py), armed against this process."""
    argv = list(spec["argv"])
    if spec.get("runtime", True):
        return argv
    import shutil

    if shutil.which(argv[0]) is None:
        raise FileNotFoundError(2, "No such file or directory")
    from dsrun import deathsig

    return deathsig.wrapper_argv(sys.executable, os.getpid(), argv)


#: Linux's limit on one argument or ``NAME=value`` string (MAX_ARG_STRLEN:
#: 32 pages, the terminating NUL included).
_ONE_STRING_MAX = 32 * 4096


def _size(n: int) -> str:
    return f"{n} bytes" if n < 10_000 else f"{n / 1000:.0f} kB" if n < 10_000_000 \
        else f"{n / 1_000_000:.0f} MB"


def start_error(program: str, exc: OSError, argv: list[str], env: dict[str, str]) -> str:
    """Why ``program`` could not be started. For "Argument list too long"
    (E2BIG) it says whether the environment or the arguments are too big:
    their sizes, and the name (never the value: it may be a secret) of the
    largest variable or the position of the largest argument."""
    message = f"cannot start {program}: {exc.strerror}"
    if exc.errno != errno.E2BIG:
        return message
    entries = [len(k.encode()) + len(v.encode()) + 2 for k, v in env.items()]
    env_total = sum(entries)
    args = [len(a.encode()) + 1 for a in argv]
    largest = max(env, key=lambda k: len(k.encode()) + len(env[k].encode()), default=None)
    biggest = max(entries, default=0)
    arg_at = max(range(len(args)), key=args.__getitem__, default=None)
    if largest is not None and (biggest > _ONE_STRING_MAX or
                                (env_total >= sum(args) and max(args) <= _ONE_STRING_MAX)):
        one = (f", over Linux's limit of {_ONE_STRING_MAX // 1024} KiB for one variable"
               if biggest > _ONE_STRING_MAX else "")
        return (f"{message}: the environment is too big ({_size(env_total)} in {len(env)} "
                f"variables; the largest is {largest}, {_size(biggest)}{one}; the "
                f"arguments are {_size(sum(args))})")
    if arg_at is None:
        return message
    return (f"{message}: the arguments are too big ({_size(sum(args))} in {len(args)}; the "
            f"largest is argument {arg_at}, {_size(args[arg_at])}; the environment is "
            f"{_size(env_total)})")


def login_environ() -> dict[str, str]:
    """The environment this agent was started in, as its ranks inherit it:
    with the login environment's PYTHONPATH where the backend gave the
    agent its ranks' one (protocol.PYTHONPATH_WAS; backends/agent_env.py)."""
    from dsrun.launcher.protocol import PYTHONPATH_WAS

    env = dict(os.environ)
    was = env.pop(PYTHONPATH_WAS, None)
    if was is not None:
        env.pop("PYTHONPATH", None)
        if was:
            env["PYTHONPATH"] = was[1:]
    return env


def hostname() -> str:
    return os.uname().nodename


#: Where a temporary directory is made when none of TMPDIR, TEMP and TMP
#: can be used: tempfile.gettempdir()'s list (the working directory last).
_FALLBACK_TMP = ("/tmp", "/var/tmp", "/usr/tmp")


class NoTmpdir(SystemExit):
    """No temporary directory could be made anywhere. A SystemExit: the
    agent makes its directory before its own error handling exists, and
    must exit with this one line (and nothing started), not a traceback."""


def tmp_candidates(environ: dict[str, str] | None = None) -> list[tuple[str, str]]:
    """The directories tried for the agent's temporary directory, as
    (absolute path, how an error names it), in the order of
    tempfile.gettempdir() (tempfile itself, with shutil and random, is not
    imported: the agent's start-up CPU is paid once per host). Absolute, so
    that a rank that changes directory still finds its error file under a
    relative TMPDIR."""
    env = os.environ if environ is None else environ
    try:
        here: str | None = os.getcwd()
    except OSError:  # a deleted working directory: relative names cannot be placed
        here = None
    named = [(env.get(var), var) for var in ("TMPDIR", "TEMP", "TMP")]
    found: dict[str, str] = {}
    for base, var in [*named, *((d, "") for d in _FALLBACK_TMP), (here, "")]:
        if not base or (here is None and not os.path.isabs(base)):
            continue
        full = os.path.normpath(os.path.join(here or "/", base))
        label = f"{var}={base}" + (f" ({full})" if full != base else "") if var else full
        found.setdefault(full, label)
    return list(found.items())


def make_tmpdir(prefix: str) -> str:
    """A private directory for the ranks' error and stack files, in the first
    of tmp_candidates() where one can be made, as tempfile does: a TMPDIR
    that is missing, a file or read-only (or a read-only /tmp) is passed
    over, not fatal. NoTmpdir when none can be used."""
    failures: list[str] = []
    for base, label in tmp_candidates():
        for _ in range(100):  # names taken: tempfile's TMP_MAX is as patient
            path = os.path.join(base, f"{prefix}{os.urandom(4).hex()}")
            try:
                os.mkdir(path, 0o700)
                return path
            except FileExistsError:
                continue
            except OSError as exc:
                failures.append(f"{label}: {exc.strerror}")
                break
    raise NoTmpdir(f"dsrun: error: the node agent on {hostname()} cannot create its "
                   f"temporary directory (for the ranks' error files) in any of: "
                   f"{'; '.join(failures) or 'no directory to try'}; no rank was started")


def remove_tmpdir(path: str) -> None:
    try:
        with os.scandir(path) as entries:
            for entry in entries:
                os.unlink(entry.path)
        os.rmdir(path)
    except OSError:
        pass


def deepspeed_shm_name(env: dict[str, str], rank: int) -> str:
    """The shared-memory segment DeepSpeed's CPU all-reduce creates for
    ``rank`` when every rank is on one host (its ``shm.cpp``: uid, master
    address and port, rank), and never removes: a job of dsrun's gets a new
    port each time, so the agent removes it when the job's processes are gone."""
    return (f"deepspeed_allreduce_buffer_{os.getuid()}_{env.get('MASTER_ADDR', '')}_"
            f"{env.get('MASTER_PORT', '')}_{rank}")


def remove_own_shm(name: str) -> None:
    path = os.path.join("/dev/shm", name)
    try:
        if name and "/" not in name and os.stat(path).st_uid == os.getuid():
            os.unlink(path)
    except OSError:
        pass


def stopped(pid: int) -> bool:
    """Whether process ``pid`` is stopped by a signal (SIGSTOP, SIGTSTP:
    state T in /proc; False where there is no /proc)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] == b"T"
    except (OSError, IndexError):
        return False


def wait_status(info: os.waitid_result) -> int:
    """As Popen.returncode: the exit code, or minus the signal's number."""
    return info.si_status if info.si_code == os.CLD_EXITED else -info.si_status


def dsrun_sources(root: str | None = None) -> tuple[str, str]:
    """Where this process's dsrun package is (or ``root``), and a digest of
    its Python sources: two hosts (or the launcher and an agent) with the
    same version string may still run different copies (a checkout on
    PYTHONPATH here, an installed one there)."""
    if root is None:
        import dsrun

        root = os.path.dirname(os.path.abspath(dsrun.__file__))
    digest = hashlib.sha256()
    for top, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        for name in sorted(files):
            if name.endswith(".py"):
                path = os.path.join(top, name)
                digest.update(os.path.relpath(path, root).encode() + b"\0")
                try:
                    with open(path, "rb") as f:
                        digest.update(f.read())
                except OSError:
                    digest.update(b"?")
    return root, digest.hexdigest()[:16]


class LogOpenError(Exception):
    """A rank's ``--log_dir`` file cannot be opened (the message names it)."""


def open_rank_logs(log_dir: str | None, ranks: list[int], header: str) -> dict[int, IO[str]]:
    """Each rank's ``--log_dir`` file (rank -> file, ``header`` written), all
    or none: LogOpenError names the first that cannot be opened."""
    logs: dict[int, IO[str]] = {}
    if not log_dir:
        return logs
    path = log_dir
    try:
        os.makedirs(log_dir, exist_ok=True)
        for rank in ranks:
            path = os.path.join(log_dir, f"rank_{rank}.log")
            logs[rank] = open(path, "a", encoding="utf-8")  # noqa: SIM115 - kept open
            busy = _claim_log(logs[rank].fileno(), path)
            if busy:
                raise LogOpenError(busy)
    except (OSError, LogOpenError) as exc:
        for log in logs.values():
            log.close()
        if isinstance(exc, LogOpenError):
            raise
        raise LogOpenError(f"cannot open the --log_dir file {path}: [Errno {exc.errno}] "
                           f"{exc.strerror}") from None
    for log in logs.values():
        log.write(header)
        log.flush()  # at once: a job refused by the lock reads it to name this one
    return logs


#: How often, 20 ms apart, a --log_dir file's lock is tried: another job's
#: preflight check holds it for an instant, a running job for its lifetime.
_LOCK_TRIES = 50


def _claim_log(fd: int, path: str, check: bool = False) -> str | None:
    """Take the ``--log_dir`` file's lock (flock, held while ``fd`` is open:
    the job's lifetime on this host), or why not: another running job holds
    it, and its lines would interleave with this job's. ``check``: only a
    shared lock, which two jobs' preflight checks can take at once. A file
    system without flock (some NFS mounts) is not an error: the file is
    used unlocked, as before."""
    import fcntl

    mode = (fcntl.LOCK_SH if check else fcntl.LOCK_EX) | fcntl.LOCK_NB
    for attempt in range(_LOCK_TRIES):
        try:
            fcntl.flock(fd, mode)
            return None
        except BlockingIOError:
            if attempt + 1 < _LOCK_TRIES:
                time.sleep(0.02)
        except OSError:  # ENOLCK, EOPNOTSUPP, ...: no locks here
            return None
    return (f"the --log_dir file {path} is being written by {_log_writer(path)}; "
            f"two jobs' lines would interleave in it: give this job another --log_dir")


#: How far back from a log file's end its writer's header line is looked for.
_HEADER_SEARCH = 1 << 20


def _log_writer(path: str) -> str:
    """Who holds ``path``'s lock, as its last header line names it
    (open_rank_logs: ``# dsrun job ID restart N host H DATE TIME``)."""
    try:
        with open(path, "rb") as f:
            end = f.seek(0, os.SEEK_END)
            f.seek(max(0, end - _HEADER_SEARCH))
            tail = f.read()
    except OSError:
        tail = b""
    at = tail.rfind(b"# dsrun job ")
    fields = tail[at:].split(b"\n", 1)[0].decode("utf-8", "replace").split() if at >= 0 else []
    if len(fields) >= 10 and fields[4] == "restart" and fields[6] == "host":
        # The id as that job's launcher printed it (and `dsrun stack` takes it).
        return (f"another running dsrun job, job id {fields[3][:12]} (on {fields[7]}, "
                f"since {fields[8]} {fields[9]})")
    return "another running process (no dsrun job header found in it)"


def log_files_problem(paths: list[str]) -> str | None:
    """Why one of the ranks' ``--log_dir`` files cannot be opened for
    appending here, or None. Nothing is left behind: a file or directory
    the check creates (as the agent would) is removed again, and an
    existing file is opened without being changed."""
    made: list[str] = []
    try:
        for path in paths:
            problem = _log_file_problem(path, made)
            if problem:
                return problem
        return None
    finally:
        for path in reversed(made):  # files, then their directories, deepest first
            try:
                os.rmdir(path) if os.path.isdir(path) else os.unlink(path)
            except OSError:
                pass


#: How often one log file's check is tried when its directory vanishes
#: between creating it and opening the file in it.
_LOG_CHECK_TRIES = 8


def _log_file_problem(path: str, made: list[str]) -> str | None:
    parent = os.path.dirname(path) or "."
    for attempt in range(_LOG_CHECK_TRIES):
        missing = []
        top = parent
        while top and not os.path.exists(top):
            missing.append(top)
            top = os.path.dirname(top)
        try:
            os.makedirs(parent, exist_ok=True)
            made.extend(reversed(missing))
            existed = os.path.lexists(path)
            fd = os.open(path, os.O_WRONLY | os.O_APPEND
                         | (0 if existed else os.O_CREAT | os.O_EXCL), 0o666)
            try:
                busy = _claim_log(fd, path, check=True) if existed else None  # the close frees it
            finally:
                os.close(fd)
            if not existed:
                made.append(path)
            if busy:
                return busy
        except FileNotFoundError as exc:
            # Hosts sharing a --log_dir (NFS) check it at once, and another
            # host's check removes the directories it made: make them again.
            if attempt + 1 < _LOG_CHECK_TRIES:
                continue
            return f"cannot open the --log_dir file {path}: [Errno {exc.errno}] {exc.strerror}"
        except OSError as exc:
            return f"cannot open the --log_dir file {path}: [Errno {exc.errno}] {exc.strerror}"
        return None
    return None


def read_error_file(path: str) -> dict[str, Any] | None:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def exit_now(code: int) -> None:
    """Leave without the interpreter's teardown, which would flush stdout
    into a dead channel (and could block there)."""
    for stream in (sys.stderr,):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


def open_std_fds() -> None:
    """Started with stdin, stdout or stderr closed (``dsrun ... 2>&-``): put
    /dev/null there first, so no pipe or file of the agent's lands on fds 0-2
    - the guard puts /dev/null over them, and would lose its pipe."""
    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
        except OSError:
            null = os.open(os.devnull, os.O_RDWR)  # the lowest free fd: this one
            if null != fd:
                os.dup2(null, fd)
                os.close(null)
    if sys.stderr is None:  # Python found fd 2 closed at start-up
        sys.stderr = open(2, "w", closefd=False)  # noqa: SIM115 - the process's stderr
