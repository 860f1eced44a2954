"""Python stacks of a running rank, on request (``dsrun stack``, ``--timeout``).

Rank side (:func:`install`, called by the injected runtime first thing):
``faulthandler.register`` writes every thread's Python stack to the rank's
stack file (``DSRUN_STACK_FILE``, set by its node agent) whenever the rank
receives :data:`STACK_SIGNAL`. faulthandler's handler runs in C at signal
delivery, so it answers even when the rank is blocked inside a collective
or any other C call. The file is opened for appending and only then given
its final name, so the file's existence means "the handler is installed".

Agent side (:func:`request`): note the file's size, send the signal, wait
until the file stops growing, return what was appended. A rank without the
file (``--no_python``, or still starting up) is never signalled: the
default action of the signal would kill it.

The signal is SIGRTMIN+4 (:data:`STACK_SIGNAL_NAME`), a real-time one,
which scripts and libraries do not use (SIGUSR1/SIGUSR2 are taken by
Slurm requeue handlers, Lightning, ...). A script that ignores it, blocks it
in every thread or installs a handler of its own for it (one for every
signal) cannot answer: the agent says which (:func:`deaf`, :func:`silent`), as
it says when the rank is in a kernel wait (state D) or stopped.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from typing import IO, Any

#: Environment variable naming the rank's stack file (set by its agent).
STACK_FILE_VAR = "DSRUN_STACK_FILE"
#: The signal that asks a rank for its stacks.
STACK_SIGNAL = signal.SIGRTMIN + 4 if hasattr(signal, "SIGRTMIN") else None
STACK_SIGNAL_NAME = "SIGRTMIN+4"

_installed: IO[str] | None = None  # the open file; faulthandler keeps only its fd


def install(path: str | None) -> bool:
    """Write all threads' stacks to ``path`` on :data:`STACK_SIGNAL`."""
    global _installed
    if not path or STACK_SIGNAL is None or _installed is not None:
        return False
    import faulthandler

    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        stream = open(tmp, "a", encoding="utf-8")  # noqa: SIM115 - held for the process
        faulthandler.register(STACK_SIGNAL, file=stream, all_threads=True, chain=False)
        os.replace(tmp, path)
    except (OSError, ValueError, RuntimeError):
        return False
    _installed = stream
    return True


_RUNTIME_FRAMES = ('File "<frozen runpy>"', f'{os.sep}dsrun{os.sep}runtime{os.sep}bootstrap.py"')


def without_runtime_frames(text: str) -> str:
    """The stacks without the frames of runpy and the injected runtime below
    the script (they are the same in every rank)."""
    return "".join(ln for ln in text.splitlines(keepends=True)
                   if not (ln.lstrip().startswith("File ") and
                           any(mark in ln for mark in _RUNTIME_FRAMES)))


def request(pid: int, path: str, timeout: float = 2.0, settle: float = 0.1) -> str | None:
    """The stacks of the rank ``pid`` whose stack file is ``path``.

    None when the rank has no handler (no file) or is gone; otherwise the
    text it wrote (possibly empty if it did not answer within ``timeout``).
    """
    if STACK_SIGNAL is None:
        return None
    try:
        start = os.path.getsize(path)
    except OSError:
        return None
    try:
        os.kill(pid, STACK_SIGNAL)
    except (ProcessLookupError, PermissionError):
        return None
    deadline = time.monotonic() + timeout
    size, stable_since = start, time.monotonic()
    while time.monotonic() < deadline:
        time.sleep(0.02)
        try:
            now = os.path.getsize(path)
        except OSError:
            return None
        if now != size:
            size, stable_since = now, time.monotonic()
        elif size > start and time.monotonic() - stable_since >= settle:
            break
    try:
        with open(path, "rb") as f:
            f.seek(start)
            text = f.read(size - start).decode("utf-8", "replace")
    except OSError:
        return None
    return without_runtime_frames(text)


def deaf(rank: int, pid: int, path: str) -> str | None:
    """Why the rank ``pid`` (stack file ``path``) cannot get the stack
    signal - it ignores it, or blocks it in every thread (/proc: SigIgn,
    SigBlk) - as a line of the answer; None when it can, when /proc cannot
    say, or when it has no handler to answer with (no file: not signalled)."""
    if STACK_SIGNAL is None or not os.path.exists(path):
        return None
    from dsrun.launcher import procs  # the agent's side only

    what = f"{STACK_SIGNAL_NAME}, dsrun's stack signal"
    if procs.ignores(pid, STACK_SIGNAL):
        return (f"(no stack: rank {rank} ignores {what} (SIG_IGN): leave that signal "
                f"alone in the script)")
    if procs.blocks(pid, STACK_SIGNAL):
        return (f"(no stack: rank {rank} blocks {what}, in every thread (pthread_sigmask): "
                f"leave that signal unblocked in the script)")
    return None


def proc_state(pid: int) -> str | None:
    """The state letter of process ``pid`` (/proc/PID/stat: R running, S
    sleeping, D uninterruptible sleep, T/t stopped, Z exited); None when it
    is gone or there is no /proc."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0].decode()
    except (OSError, IndexError, UnicodeDecodeError):
        return None


def silent(rank: int, timeout: float = 2.0, state: str | None = None) -> str:
    """The answer of a rank that was sent the stack signal and wrote nothing;
    ``state``: its :func:`proc_state` then, which says why when it can."""
    if state == "D":  # the handler runs only once the kernel call returns
        return (f"(no answer: rank {rank} is in uninterruptible sleep (a kernel wait: "
                f"I/O on a hung file system, a driver call); it cannot answer, nor act on "
                f"any signal but SIGKILL, until that returns)")
    if state in ("T", "t"):
        return (f"(no answer: rank {rank} is stopped (SIGSTOP, a debugger): it cannot "
                f"answer until it is continued)")
    return (f"(no answer: rank {rank} did not write its stack within {timeout:g}s; likely "
            f"a handler of the script's own for {STACK_SIGNAL_NAME}, dsrun's stack signal - "
            f"one set for every signal - replaced dsrun's)")


def answers(ranks: list[Any]) -> Iterator[dict[str, Any]]:
    """The agent's answer for each of its running ``ranks`` (agent_output.Rank):
    ``{rank, pid, text}``, text None for a rank without a handler, and
    ``stopped`` for one stopped by a signal, which could not answer."""
    for rank in ranks:
        pid = rank.popen.pid
        if proc_state(pid) in ("T", "t"):  # it could not answer: say why, not wait
            yield {"rank": rank.rank, "pid": pid, "text": None, "stopped": True}
            continue
        # one that ignores or blocks the signal is named, not waited for
        text = deaf(rank.rank, pid, rank.stack_file) or request(pid, rank.stack_file)
        if text == "":
            text = silent(rank.rank, state=proc_state(pid))
        yield {"rank": rank.rank, "pid": pid, "text": text}
