"""SIGUSR1 and SIGUSR2 in the node agent: never a stop, never its death;
passed on to its ranks' process groups (as torchrun's
``--signals_to_handle`` passes on the signals listed there).

Such a signal reaches the agent two ways: the launcher's ``signal``
command (dsrun itself got it: ``kill -USR1 $LAUNCHER_PID`` in a Slurm
batch script's trap) or the agent's own handler. A signal sent to every
process of the job (Slurm's ``scancel --signal=USR1 --full``, a signal to
the job's cgroup) reaches the ranks directly, and the agent and the
launcher too; so a rank gets one copy, not two:

- the launcher's command is forwarded, unless the agent itself got the
  same signal within :data:`MERGE` seconds before (then everyone got it);
- the agent's own signal is forwarded only if no command for it follows
  within :data:`MERGE` seconds (it was sent to the agent alone: ``mpirun``
  passing on a signal to its processes, which are the agents), and not at
  all if a forward of it went out within :data:`MERGE` seconds before (the
  launcher was quicker).

A task of a Slurm step (srun started the agent: its parent is
``slurmstepd``) is different where Slurm delivers every signal meant for the
step - ``scancel --signal``, ``#SBATCH --signal`` without ``B:``, srun
passing on one it got - to every process of the step, the ranks included:
with ``ProctrackType=proctrack/cgroup`` (the step's cgroup holds them) or
``proctrack/linuxproc`` (it tracks the task's descendants)
(:func:`ranks_get_step_signals`). There the agent's own copy means the
ranks have theirs, so it is never forwarded, and the launcher's command
waits :data:`MERGE` seconds and is dropped if the agent's own copy comes
meanwhile. (A signal to every process of the batch job also reaches srun,
which passes it on once more: that second copy is Slurm's, and reaches the
ranks whatever the agent does.) ``proctrack/pgid`` signals only each task's
process group, the agent's - every rank leads a group of its own - so
there, and wherever the tracking is not known, the general rule holds.

Signals are taken while the job runs; once it is being stopped they are
dropped. The handler only appends to a list (a signal handler must not
take a lock the code it interrupted may hold). Standard library only.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable

#: The signals forwarded to the ranks (latch.FORWARDED on the launcher's side).
FORWARDED = (signal.SIGUSR1, signal.SIGUSR2)
#: Seconds within which the agent's own copy of a signal and the
#: launcher's command for it are taken for one delivery to the whole job.
MERGE = 0.5

#: (signum, from the launcher): appended by the handler and the command reader.
_PENDING: list[tuple[int, bool]] = []


def in_slurm_step() -> bool:
    """Whether this process is a task of a Slurm step: its parent is
    slurmstepd (Linux; elsewhere, or inside a container whose PID namespace
    hides the parent, False: the general rule then applies)."""
    try:
        with open(f"/proc/{os.getppid()}/comm") as f:
            return f.read().strip() == "slurmstepd"
    except OSError:
        return False


#: Where slurm.conf is read when ``SLURM_CONF`` does not say (the
#: packaged paths, then slurmd's cache of a configless cluster's file).
SLURM_CONFS = ("/etc/slurm/slurm.conf", "/etc/slurm-llnl/slurm.conf",
               "/run/slurm/conf/slurm.conf", "/var/spool/slurmd/conf-cache/slurm.conf")


def proctrack_of(conf: str) -> str | None:
    """``ProctrackType`` in a slurm.conf text, lower case (pure)."""
    found = None
    for line in conf.splitlines():
        key, _, value = line.split("#", 1)[0].partition("=")
        if key.strip().lower() == "proctracktype" and value.strip():
            found = value.strip().split()[0].lower()
    return found


def in_step_cgroup(cgroups: str) -> bool:
    """Whether ``/proc/self/cgroup`` text puts this process in a Slurm
    step's cgroup (``.../job_N/step_M/...``; pure)."""
    return any("/job_" in line and "/step_" in line for line in cgroups.splitlines())


def ranks_get_step_signals(environ: dict[str, str] | None = None) -> bool:
    """Whether Slurm's signals to this agent's step reach its ranks too:
    slurm.conf's ProctrackType is not ``proctrack/pgid``, or, where it cannot
    be read, this process is in a step's cgroup (module docstring)."""
    env = os.environ if environ is None else environ
    for path in (env.get("SLURM_CONF"), *SLURM_CONFS):
        try:
            if path:
                with open(path, errors="replace") as f:
                    kind = proctrack_of(f.read(1_000_000))
                if kind is not None:
                    return kind != "proctrack/pgid"
        except OSError:
            continue
    try:
        with open("/proc/self/cgroup") as f:
            return in_step_cgroup(f.read())
    except OSError:
        return False


def on_signal(signum: int, frame: object) -> None:
    """The agent's handler of :data:`FORWARDED` (installed before any thread)."""
    _PENDING.append((int(signum), False))


def install() -> None:
    for sig in FORWARDED:
        signal.signal(sig, on_signal)


def from_launcher(name: object) -> None:
    """The launcher's ``signal`` command {"signal": "SIGUSR1"} (other names: ignored)."""
    sig = next((s for s in FORWARDED if s.name == name), None)
    if sig is not None:
        _PENDING.append((int(sig), True))


def take() -> list[tuple[int, bool]]:
    taken, _PENDING[:] = list(_PENDING), []
    return taken


class Forwarder:
    """When the agent forwards which signal (see the module docstring);
    ``send(signum)`` signals the running ranks' groups."""

    def __init__(self, send: Callable[[int], None],
                 clock: Callable[[], float] = time.monotonic,
                 step: bool | None = None) -> None:
        """``step``: the agent is a task of a Slurm step whose signals reach
        its ranks too (None: find out, :func:`in_slurm_step` and
        :func:`ranks_get_step_signals`)."""
        self.send = send
        self.clock = clock
        self.step = in_slurm_step() and ranks_get_step_signals() if step is None else step
        self.heard: dict[int, float] = {}  # the agent's own copy, last seen
        self.sent: dict[int, float] = {}  # the last forward
        self.waiting: dict[int, float] = {}  # own copies not yet forwarded
        self.commands: dict[int, float] = {}  # the launcher's, held (a Slurm step only)

    def note(self, signum: int, launcher: bool) -> None:
        now = self.clock()
        if self.step:
            self._note_in_step(signum, launcher, now)
        elif launcher:
            if now - self.heard.get(signum, -MERGE - 1) <= MERGE:
                self.waiting.pop(signum, None)  # sent to every process: the ranks have it
                return
            self._send(signum, now)
        elif now - self.sent.get(signum, -MERGE - 1) > MERGE:
            self.heard[signum] = now
            self.waiting.setdefault(signum, now)

    def _note_in_step(self, signum: int, launcher: bool, now: float) -> None:
        """In a Slurm step the agent's own copy says the step, ranks
        included, got the signal (the module docstring)."""
        if not launcher:
            self.heard[signum] = now
            self.commands.pop(signum, None)  # the ranks have it from Slurm
        elif now - self.heard.get(signum, -MERGE - 1) > MERGE:
            self.commands.setdefault(signum, now)

    def settle(self) -> None:
        """Forward the agent's own copies that no command followed (in a
        Slurm step: the commands no copy of the agent's own followed)."""
        now = self.clock()
        for held in (self.waiting, self.commands):
            for signum, at in list(held.items()):
                if now - at > MERGE:
                    del held[signum]
                    self._send(signum, now)

    def drop(self) -> None:
        """The job is being stopped: nothing more is forwarded."""
        self.waiting.clear()
        self.commands.clear()

    def _send(self, signum: int, now: float) -> None:
        self.sent[signum] = now
        self.send(signum)
