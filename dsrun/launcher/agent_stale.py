"""Temporary directories that dead node agents left behind.

An agent's guard removes the agent's directory (the ranks' error and stack
files) when the agent dies; both die together when srun SIGKILLs its step
(a SIGTERM to srun, scancel, a time limit), or when someone SIGKILLs the
agent and its guard, and the directory stays. The next dsrun agent of this
user on the host - of any job: an interrupted job is not restarted, so no
later agent of it may come - removes such directories.

Each agent writes :data:`OWNER` into its own directory (:func:`claim`): the
job's id, the machine's boot id, its pid namespace, and its pid and start
time (procs.Proc.line). It removes a ``dsrun-*`` directory next to its own
only when all of these hold, so that nothing a live agent uses is touched:

- it is a directory, not a link, and belongs to this user;
- its OWNER names this boot and this pid namespace (a /tmp shared between
  machines or containers is left alone; a namespace's id is reused only
  once every process in it is gone);
- the pid it names is gone, or is now another process (its start time).

An agent claims nothing, and removes nothing, where ``/proc`` is not its
own pid namespace's (``/proc/self`` is not its pid: a container that sees
the host's ``/proc``): its pid would name another process there. A
directory without an OWNER (an agent still making it, or an older dsrun's)
is left alone. Only the files in it are removed, never a subdirectory.
Kept to the standard library and procs: every agent imports it.
"""

from __future__ import annotations

import os
import stat

from dsrun.launcher.procs import Proc

#: The file naming the agent that owns a temporary directory.
OWNER = "agent"


def _machine() -> tuple[str, str] | None:
    """This boot's id and this process's pid namespace; None if unknown."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        return boot, os.readlink("/proc/self/ns/pid")
    except OSError:
        return None


def claim(tmpdir: str, job_id: str) -> list[str]:
    """Write OWNER into ``tmpdir`` (this agent's), then remove the stale
    ``dsrun-*`` directories beside it; returns those removed. Never raises: a
    directory left behind costs a few bytes, a failed agent a job."""
    machine = _machine()
    try:
        own_proc = os.readlink("/proc/self") == str(os.getpid())
    except OSError:
        own_proc = False
    me = Proc.of(os.getpid()) if own_proc else None
    if machine is None or me is None:
        return []
    try:
        with open(os.path.join(tmpdir, OWNER), "w") as f:
            f.write(f"{job_id}\n{machine[0]}\n{machine[1]}\n{me.line()}\n")
    except OSError:
        return []
    prefix = "dsrun-"
    base = os.path.dirname(tmpdir)
    removed = []
    try:
        names = [n for n in os.listdir(base) if n.startswith(prefix)]
    except OSError:
        return []
    for name in names:
        path = os.path.join(base, name)
        if path != tmpdir and _stale(path, machine):
            _remove(path)
            removed.append(path)
    return removed


def _stale(path: str, machine: tuple[str, str]) -> bool:
    """Whether ``path`` is the directory of an agent of this machine that is gone."""
    try:
        info = os.lstat(path)
        if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
            return False
        with open(os.path.join(path, OWNER)) as f:
            lines = f.read().splitlines()
    except OSError:
        return False
    if len(lines) != 4 or (lines[1], lines[2]) != machine:
        return False
    owner = Proc.parse(lines[3])
    return owner is not None and owner.pid != os.getpid() and not owner.ours()


def _remove(path: str) -> None:
    """The files in ``path``, then ``path`` if it is empty then."""
    try:
        with os.scandir(path) as entries:
            for entry in entries:
                if not entry.is_dir(follow_symlinks=False):
                    os.unlink(entry.path)
        os.rmdir(path)
    except OSError:
        pass
