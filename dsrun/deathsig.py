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

The same first act binds the rank to its CPUs under ``--bind_cores_to_rank``
(:func:`bind_cpus`, from ``DSRUN_CPU_AFFINITY``; dsrun/launcher/cores.py),
before the rank starts any thread.
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Iterable, Mapping

#: Environment variable naming the agent's pid (set by the agent on each rank).
AGENT_PID_VAR = "DSRUN_AGENT_PID"
_PR_SET_PDEATHSIG = 1
#: The CPUs a rank binds itself to ("0-3,8"), set by dsrun for --bind_cores_to_rank.
AFFINITY_VAR = "DSRUN_CPU_AFFINITY"
#: Exit status of a rank whose agent died before it could arm the signal.
ORPHANED = 137
#: CPU numbers are below this. Linux builds for at most 8192 CPUs (NR_CPUS);
#: a bigger number is a typo, and a range up to it would fill memory.
MAX_CPU = 1 << 16


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


def _number(text: str) -> bool:
    return text.isascii() and text.isdigit()


def cpu_set(text: str) -> set[int]:
    """``"0-3,8"`` -> ``{0, 1, 2, 3, 8}``; ValueError naming a bad entry."""
    cpus: set[int] = set()
    for part in text.replace(" ", "").split(","):
        first, dash, last = part.partition("-")
        if not _number(first) or (dash and not _number(last)):
            raise ValueError(f"{part!r} is not a CPU number or a range A-B")
        if max(len(first.lstrip("0")), len(last.lstrip("0"))) > len(str(MAX_CPU)):
            # int() of a 5000-digit string fails; a long number is too big anyway
            raise ValueError(f"{part!r}: CPU numbers must be below {MAX_CPU}")
        low, high = int(first), int(last) if dash else int(first)
        if high < low:
            raise ValueError(f"{part!r} is not a range of CPU numbers (A-B needs A <= B)")
        if high >= MAX_CPU:
            raise ValueError(f"{part!r}: CPU numbers must be below {MAX_CPU}")
        cpus.update(range(low, high + 1))
    return cpus


def format_cpu_list(cpus: Iterable[int]) -> str:
    """``(0, 1, 2, 3, 8)`` -> ``"0-3,8"`` (the inverse of :func:`cpu_set`)."""
    parts: list[str] = []
    values = sorted(set(cpus))
    i = 0
    while i < len(values):
        j = i
        while j + 1 < len(values) and values[j + 1] == values[j] + 1:
            j += 1
        parts.append(str(values[i]) if i == j else f"{values[i]}-{values[j]}")
        i = j + 1
    return ",".join(parts)


def bind_cpus(environ: Mapping[str, str]) -> str | None:
    """Pin this process (and every thread it starts later) to the CPUs in
    ``DSRUN_CPU_AFFINITY`` (``--bind_cores_to_rank``). Returns None when
    done or not asked for, else why it failed (one line)."""
    text = environ.get(AFFINITY_VAR)
    if not text or not hasattr(os, "sched_setaffinity"):
        return None
    try:
        os.sched_setaffinity(0, cpu_set(text))
    except (OSError, ValueError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        return (f"cannot bind this rank to CPUs {text} ({AFFINITY_VAR}, from "
                f"--bind_cores_to_rank): {reason}; this process may run on CPUs "
                f"{format_cpu_list(os.sched_getaffinity(0))}")
    return None


def wrapper_argv(python: str, parent: int, argv: list[str]) -> list[str]:
    """The argv that starts ``argv`` through this file as an exec wrapper."""
    return [python, "-I", "-S", os.path.abspath(__file__), str(parent), "--", *argv]


def _main(args: list[str]) -> int:
    if len(args) < 3 or args[1] != "--" or not args[0].isdigit():
        sys.stderr.write("usage: deathsig.py AGENT_PID -- ARGV...\n")
        return 2
    die_with_parent(int(args[0]))
    failed = bind_cpus(os.environ)
    if failed:
        sys.stderr.write(f"dsrun: error: {failed}\n")
        return 1
    argv = args[2:]
    try:
        os.execvp(argv[0], argv)
    except OSError as exc:
        sys.stderr.write(f"cannot start {argv[0]}: {exc.strerror}\n")
        return 127
    return 0  # not reached


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
