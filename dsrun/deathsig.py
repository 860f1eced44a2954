"""A rank dies with its node agent: the parent-death signal, set by the rank.

The node agent is threaded, so it may not run Python code between fork and
exec (``preexec_fn`` is unsafe there). Instead the rank sets its own
parent-death signal (``prctl(PR_SET_PDEATHSIG, SIGKILL)``) as its first act,
then checks that its parent is still the agent that started it (named by
``DSRUN_AGENT_PID``): if the agent died before the prctl took effect, the
rank exits at once.

- Python ranks: the injected runtime calls :func:`die_with_parent` before
  anything else (bootstrap.py), at no extra process cost.
- Ranks started with ``--no_python``: the agent starts them through this
  file as a tiny exec wrapper, ``python -I -S deathsig.py AGENT_PID --
  ARGV...``, which sets the signal and ``exec``s ARGV (the signal survives
  exec). The wrapper imports nothing of dsrun, so it costs one bare
  interpreter start.

The signal is tied to the agent's *thread* that spawned the rank: the agent
spawns every rank from its main thread, which lives until the agent exits.
Linux only; elsewhere this is a no-op (the agent's guard still cleans up).
"""

from __future__ import annotations

import os
import signal
import sys

#: Environment variable naming the agent's pid (set by the agent on each rank).
AGENT_PID_VAR = "DSRUN_AGENT_PID"
_PR_SET_PDEATHSIG = 1
#: Exit status of a rank whose agent died before it could arm the signal.
ORPHANED = 137


def die_with_parent(parent: int | None) -> bool:
    """Arm SIGKILL-on-parent-death; exit if ``parent`` is already gone.

    Returns whether the signal is armed (False off Linux or without libc).
    ``parent`` None: only arm it. A process whose parent is not ``parent``
    while ``parent`` lives was not started by the agent (a rank's own child
    that runs the runtime inherits the variable): the signal is disarmed.
    """
    if not sys.platform.startswith("linux"):
        return False
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        armed = libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False
    if parent is not None and os.getppid() != parent:
        if not _alive(parent):
            os._exit(ORPHANED)  # the agent died before the prctl took effect
        libc.prctl(_PR_SET_PDEATHSIG, 0, 0, 0, 0)
        return False
    return armed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def agent_pid(environ: dict[str, str] | os._Environ[str]) -> int | None:
    value = environ.get(AGENT_PID_VAR, "")
    return int(value) if value.isdigit() else None


def wrapper_argv(python: str, parent: int, argv: list[str]) -> list[str]:
    """The argv that starts ``argv`` through this file as an exec wrapper."""
    return [python, "-I", "-S", os.path.abspath(__file__), str(parent), "--", *argv]


def _main(args: list[str]) -> int:
    if len(args) < 3 or args[1] != "--" or not args[0].isdigit():
        sys.stderr.write("usage: deathsig.py AGENT_PID -- ARGV...\n")
        return 2
    die_with_parent(int(args[0]))
    argv = args[2:]
    try:
        os.execvp(argv[0], argv)
    except OSError as exc:
        sys.stderr.write(f"cannot start {argv[0]}: {exc.strerror}\n")
        return 127
    return 0  # not reached


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
