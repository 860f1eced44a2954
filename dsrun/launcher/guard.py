"""Watchdog that outlives a node agent killed without warning.

Each agent forks one guard before it starts any thread (so the fork is
safe, and the guard costs no interpreter start): the guard leaves the
agent's session, ignores the usual signals (and SIGUSR1/2), lets go of every file the
agent holds (so the agent's channel closes when the agent dies) and reads
a pipe from the agent: ``marker M SINCE`` (the agent's marker and start
time), ``tmpdir PATH`` (the ranks' error and stack files), then one
``PID START_TIME`` line per rank (procs.Leader) and one ``escaped PID
START_TIME`` line per job process the agent found outside every rank's
group (procs.outside_groups: the agent is their subreaper, the guard is
not, so without this record those that also dropped the marker would
outlive the agent). If the pipe closes
without the final ``done`` line, the agent died (SIGKILL, OOM killer)
before it could tear its ranks down, so the guard kills every process of
the job: the ranks' groups - only those whose leader is still the process
that was started - anything carrying the agent's environment marker, and
each recorded escaped process still alive with its descendants;
then it removes the agent's temporary directory.
"""

from __future__ import annotations

import os
import signal
import sys

from dsrun.launcher.procs import Leader, Proc, kill_job


class Guard:
    """The agent's end of its guard."""

    def __init__(self) -> None:
        read, self._write = os.pipe()
        self.pid = os.fork()
        if self.pid == 0:  # pragma: no cover - the child never returns
            try:
                os.close(self._write)
                _run_guard(read)
            finally:
                os._exit(0)
        os.close(read)

    def _send(self, line: str) -> None:
        try:
            os.write(self._write, f"{line}\n".encode())
        except OSError:
            pass  # the guard is gone; nothing to tell it

    def set_marker(self, marker: str, since: float = 0.0) -> None:
        self._send(f"marker {marker} {since!r}")

    def set_tmpdir(self, path: str) -> None:
        self._send(f"tmpdir {path}")

    def watch(self, leader: Leader) -> None:
        self._send(leader.line())

    def escaped(self, proc: Proc) -> None:
        """A job process outside every rank's group: killed too if the agent dies."""
        self._send(f"escaped {proc.line()}")

    def died(self) -> str | None:
        """How the guard ended, if it has (before ``done``: someone killed
        it, and the job is no longer protected against the agent's death)."""
        if self._write < 0:
            return None
        try:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
        except ChildProcessError:
            return "gone"
        if pid == 0:
            return None
        self._write, fd = -1, self._write
        os.close(fd)
        if os.WIFSIGNALED(status):
            return f"killed by {signal.Signals(os.WTERMSIG(status)).name}"
        return f"exited with status {os.waitstatus_to_exitcode(status)}"

    def done(self) -> None:
        """Everything is torn down: the guard exits without killing."""
        if self._write < 0:
            return
        self._send("done")
        os.close(self._write)
        self._write = -1
        try:
            os.waitpid(self.pid, 0)
        except ChildProcessError:
            pass


def _detach() -> None:
    os.setsid()
    try:  # "dsrun-guard" in ps and psutil, not a second "python ... agent"
        with open("/proc/self/comm", "w") as f:
            f.write("dsrun-guard")
    except OSError:
        pass
    # SIGUSR1/2 too: one sent to every process of the job (a Slurm requeue
    # signal) must not end the guard, which would fail the job.
    for sig in (signal.SIGINT, signal.SIGHUP, signal.SIGTERM, signal.SIGPIPE,
                signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(sig, signal.SIG_IGN)
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    if null > 2:
        os.close(null)


def _run_guard(read: int) -> None:
    _detach()
    os.closerange(3, read)
    os.closerange(read + 1, max(os.sysconf("SC_OPEN_MAX"), read + 2))
    marker: str | None = None
    since = 0.0
    tmpdir: str | None = None
    leaders: list[Leader] = []
    escaped: list[Proc] = []
    pending = b""
    while True:
        chunk = os.read(read, 4096)
        if not chunk:
            break
        pending += chunk
        *lines, pending = pending.split(b"\n")
        for raw in lines:
            line = raw.decode()
            if line == "done":
                return
            if line.startswith("marker "):
                _, marker, started = line.split(" ")
                since = float(started)
            elif line.startswith("tmpdir "):
                tmpdir = line[len("tmpdir "):]
            elif line.startswith("escaped "):
                if (proc := Proc.parse(line[len("escaped "):])) is not None:
                    escaped.append(proc)
            elif (leader := Leader.parse(line)) is not None:
                leaders.append(leader)
    if marker is not None or leaders or escaped:
        kill_job(leaders, marker, since=since, roots=escaped)
    if tmpdir is not None:
        import shutil  # only here: the agent itself never needs it
        shutil.rmtree(tmpdir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit("the guard is forked by the node agent; it is not a command")
