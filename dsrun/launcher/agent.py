"""The node agent: starts this host's ranks, streams their output, tears down.

One agent runs per host and attempt (``python -m dsrun.launcher.agent``),
started by a backend locally or over SSH, and talks to the launcher over
its stdin/stdout; under mpirun and srun one runs per rank (``--connect``:
it connects back to the launcher, callback.py, and its rank inherits the
MPI/Slurm variables). It may first answer ``probe`` commands (protocol.py),
then reads its part of the plan and reports events. End of input before the
plan means "exit, nothing was started". Guarantees:

- every rank runs in its own session/process group and dies with the agent
  (deathsig.py); no Python code runs between fork and exec; spawning stops
  at the first rank that cannot be started;
- the first rank to fail stops the others: SIGTERM to each group (SIGINT
  for the launcher's Ctrl-C: ``stop`` with ``"signal": "SIGINT"``, or
  SIGINT to the agent), SIGKILL after ``kill_grace`` seconds (at most
  agent_stop.FAILURE_GRACE when a failure began the stop). A stop
  command, end of input, a launcher silent past its heartbeat timeout
  (link.py) or a signal to the agent stop the ranks the same way; a kill
  command, end of input while stopping, or a second signal (not the first
  again within agent_os.REPEAT) SIGKILL them at
  once; ``done`` names the ranks that died of that SIGKILL (agent_stop.py);
- exited ranks stay unreaped until the teardown is over, so their pids and
  group ids cannot name anyone else's processes meanwhile (procs.py);
- before ``done`` every process of the job on this host is gone: also
  descendants that left their group (the job marker) and, on Linux, those
  that also cleared their environment (the agent is their subreaper);
  adopted orphans are reaped, the ranks only at the end of the teardown;
- a failure of the agent itself - a ``--log_dir`` file it cannot open
  (checked before any rank starts) or write, its guard killed, an error on
  any of its threads - is a ``fail`` event {message, time}: the launcher
  reports the host as failed, the ranks are stopped; never a clean ``done``;
- a signal to the agent is reported (``signal``) before it stops the ranks,
  so the launcher takes the job as interrupted by it (also one that came
  after its ranks had died of it: agent_exits.py, LINGER); later signals only
  hurry the teardown, never cut it short (orted's SIGTERM on MPI_Abort may
  come mid-stop);
- a rank that exited without posting its exit mark (``os._exit``, a
  signal: runtime/exitmark.py) has it posted by the agent, so its peers'
  checkpoint calls name it at once (agent_marks.py);
- SIGUSR1 and SIGUSR2 never stop the agent: they are passed on to the
  ranks' process groups, once per delivery (agent_forward.py);
- if the agent itself is SIGKILLed, its guard (forked before any thread
  starts; guard.py) kills the job, escaped processes included.
"""

from __future__ import annotations

import os
import sys

from dsrun.safepath import drop_cwd_entry

# Before any other import (safepath.py): the agent needs nothing from the
# job's working directory; the ranks get their own sys.path.
if __name__ == "__main__":
    drop_cwd_entry()

import queue
import signal
import subprocess
import threading
import time
from typing import IO, Any

from dsrun import deathsig, stackdump
from dsrun.launcher import agent_forward, agent_stale, procs
from dsrun.launcher.agent_commands import Commands
from dsrun.launcher.agent_exits import (
    exit_event,
    own_error,
    poll_exits,
    record_exit,
    stop_signal_of,
)
from dsrun.launcher.agent_hold import held_signals, take_held
from dsrun.launcher.agent_marks import (
    MARKED_VAR,
    StoreAddress,
    mark_if_unmarked,
    marked_file,
    store_address,
    wait_for_marks,
)
from dsrun.launcher.agent_os import (
    REPEAT,
    STOP_SIGNALS,
    LogOpenError,
    Stop,
    deepspeed_shm_name,
    hostname,
    login_environ,
    make_tmpdir,
    raise_stop,
    rank_argv,
    read_error_file,
    remove_own_shm,
    remove_tmpdir,
    start_error,
    stop_raising,
    wait_status,
)
from dsrun.launcher.agent_os import exit_now as _exit_now
from dsrun.launcher.agent_os import open_std_fds as _open_std_fds
from dsrun.launcher.agent_output import TAIL_LINES, Rank, RankOutput, close_quietly, guarded
from dsrun.launcher.agent_prelude import ConnectFailed, connect_link, read_payload
from dsrun.launcher.agent_stop import JobProcesses
from dsrun.launcher.envlayers import apply_layers
from dsrun.launcher.guard import Guard
from dsrun.launcher.link import Link

__all__ = ["TAIL_LINES", "Agent", "Rank", "main"]
#: Seconds the agent waits, before ``done``, for a stop signal of its own
#: after a rank died of one that was not the agent's stop (_await_own_signal).
LINGER = 0.5
# Imports are kept to what every agent needs (one agent starts per host and
# per attempt, all at once): planning modules, dataclasses, tempfile/shutil,
# psutil and the probe's network helpers are not among them.


class Agent(Commands):
    """One host's part of a job: starts its ranks (:meth:`run`), relays their
    output and exits, carries out the launcher's commands, and tears the job
    down on this host. Everything that happens off the main thread (rank
    exits, output, commands, thread failures) reaches the main loop through
    :attr:`events`; only the main thread stops ranks or sends ``done``."""

    def __init__(self, payload: dict[str, Any], link: Link, guard: Guard | None,
                 subreaper: bool = False) -> None:
        self.payload = payload
        self.next_check = 0.0  # time.monotonic() of the next reap / guard check
        self.job_id: str = payload["job_id"]
        # Marks this agent's processes for teardown. Per agent, not per job:
        # hosts may share a PID namespace (containers with host PIDs, the
        # simulated cluster), and one agent must never stop another's ranks.
        self.marker = f"{self.job_id}.{os.urandom(6).hex()}"
        self.link = link
        self.guard = guard
        # "exit", "eof", "stop", "kill", or (what, detail): ("fail", message)
        # a log file that cannot be written, ("crash", exception) a thread's error.
        self.events: queue.Queue[Any] = queue.Queue()
        self.ranks: list[Rank] = []
        self.stores: dict[int, StoreAddress | None] = {}  # rank -> its job's store
        self.output = RankOutput(link, lambda msg: self.events.put(("fail", msg)),
                                 self._thread_failed)
        self.exit_lock = threading.Lock()  # a rank's status and exit time, set once
        self.stack_lock = threading.Lock()
        self.stop_signal = signal.SIGTERM  # what the launcher's ``stop`` sends first
        self.stop_failure = False  # the launcher's ``stop`` is a failure's (agent_stop.py)
        self.hurried = False  # a signal during the teardown: SIGKILL now
        self.signalled: tuple[int, float] | None = None  # the agent's own stop signal, when
        self.late_signal = False  # it came after the supervision ended: said before done
        self.killed_outside = False  # a rank died of a stop signal not of the agent's stop
        self.failed = False
        self.fail_sent = False
        self.tmpdir = make_tmpdir(f"dsrun-{self.job_id[:8]}-")
        agent_stale.claim(self.tmpdir, self.job_id)  # and remove dead agents' ones
        me = procs.Proc.of(os.getpid())
        # The agent is its descendants' subreaper (main()): every process
        # below it but the guard is the job's (procs.job_processes).
        spare = frozenset({guard.pid} if guard is not None else ()) if subreaper else None
        self.job = JobProcesses(self.marker, me.started if me is not None else 0.0,
                                float(payload.get("kill_grace", 30.0)), guard, spare)
        self.forwarder = agent_forward.Forwarder(self._forward)
        if guard is not None:
            guard.set_marker(self.marker, self.job.since)
            guard.set_tmpdir(self.tmpdir)

    def emit(self, obj: dict[str, Any], control: bool = True) -> None:
        self.link.send(obj, control)

    # -- lifecycle ------------------------------------------------------------
    def run(self) -> int:
        try:
            try:
                self._supervise()
            except Exception as exc:  # noqa: BLE001 - reported as this host's failure
                self._crashed(exc)
        finally:
            stop_raising(self._hurry)  # for good: main() drains the link after this
            self._await_own_signal()
            facts = self._finish()
            if self.late_signal and self.signalled is not None and self.killed_outside:
                # The ranks were gone before the agent's own signal came (a
                # signal to the whole job that killed them first): still the
                # launcher's to know, to count their deaths with it. Not when
                # no rank died of a signal: ranks that all exited on their own
                # decide the job's outcome, whatever reached the agent after.
                self._emit_signal(self.signalled[0], True, time.monotonic() - self.signalled[1])
            self.emit({"ev": "done", **facts})
        return 1 if self.failed else 0

    def _supervise(self) -> None:
        try:
            self._start()
            self._loop()
        except Stop as stop:
            self.signalled = (stop.signum, time.monotonic())
            stop_raising(self._hurry)  # a further signal SIGKILLs, as "kill" does
            self._hurry_held()
            # The launcher must blame the signal, not the ranks it stops.
            self._emit_signal(stop.signum, self.job.stopping)
            self._begin_stop(signal.SIGINT if stop.signum == signal.SIGINT
                             else signal.SIGTERM)
            self._loop()

    def _await_own_signal(self) -> None:
        """A rank died of a stop signal that was not the agent's stop: the
        same signal sent to the whole job may reach the agent a moment later
        (after the ranks, whose teardown is quick). Wait up to LINGER for it,
        so that the launcher counts the rank with it rather than blaming it."""
        end = time.monotonic() + LINGER
        while self.killed_outside and self.signalled is None and time.monotonic() < end:
            time.sleep(0.02)

    def _emit_signal(self, signum: int, during_stop: bool, age: float = 0.0) -> None:
        self.emit({"ev": "signal", "signal": signum, "time": time.time() - age,
                   "age": round(age, 6), "during_stop": during_stop})

    def _hurry_held(self) -> None:
        """The stop signals held (agent_hold.py) behind one that raised, or
        over a step that failed: each as one that came now."""
        for signum in take_held():
            self._hurry(signum)

    def _fail(self, message: str) -> None:
        """This host fails (not one rank): the launcher reports ``message``
        and stops the job everywhere; here every rank is stopped."""
        with held_signals():  # flagged sent and sent, or neither
            if not self.fail_sent:  # the first is the cause; later ones are consequences
                self.fail_sent = True
                self.emit({"ev": "fail", "message": message, "time": time.time()})
            self.failed = True
            self._begin_stop(failure=True)

    def _crashed(self, exc: BaseException) -> None:
        """The agent's own code failed: never a clean ``done``. The ranks it
        started are stopped by _finish (they are in self.ranks from the moment
        they exist), whether or not their threads run."""
        stop_raising(self._hurry)
        self._hurry_held()
        if isinstance(exc, OSError) and exc.strerror:
            what = f"[Errno {exc.errno}] {exc.strerror}" + \
                (f": {exc.filename}" if exc.filename else "")
        else:  # a bug: its traceback goes to the launcher as agent output
            import traceback

            traceback.print_exception(type(exc), exc, exc.__traceback__, file=sys.stderr)
            sys.stderr.flush()
            what = f"{type(exc).__name__}: {exc}"
        self._fail(f"its own error: {what}")

    def _thread_failed(self, exc: BaseException) -> None:
        self.events.put(("crash", exc))

    def _hurry(self, signum: int) -> None:
        # Only a flag: a signal handler must not take a lock the interrupted
        # code may hold (the event queue's).
        first = self.signalled
        if first is None:  # the first, after the ranks had all ended: _finish hurries
            self.signalled, self.late_signal = (signum, time.monotonic()), True
        elif first[0] == signum and time.monotonic() - first[1] < REPEAT:
            return  # the same delivery again (agent_os.REPEAT): the ranks keep their grace
        self.hurried = True

    def _start(self) -> None:
        agent_forward.take()  # before any rank exists: nobody to forward them to
        self.emit({"ev": "hello", "host": hostname(), "pid": os.getpid()})
        try:
            logs = self.output.open_logs(self.payload)
        except LogOpenError as exc:  # one that cannot be opened: nothing is started
            self._fail(f"{exc}; no rank was started there")
            logs = None
        for spec in self.payload["ranks"] if logs is not None else ():
            if not self._spawn(spec, logs.pop(spec["rank"], None)):
                break  # the rest are never started: the job is failing
        for log in (logs or {}).values():  # of ranks never started
            close_quietly(log)
        for rank in self.ranks:
            self.output.start_readers(rank)
            guarded(self._wait_rank, self._thread_failed, rank)
        guarded(self._read_commands, self._thread_failed)

    def _wait_rank(self, rank: Rank) -> None:
        # A thread per rank gives each exit its own timestamp: which rank
        # failed *first* decides the root cause, and polling would blur it.
        # WNOWAIT: the rank stays a zombie, holding its pid and group id.
        try:
            try:
                info = os.waitid(os.P_PID, rank.popen.pid, os.WEXITED | os.WNOWAIT)
            except ChildProcessError:
                info = None
            if info is None:
                mono = time.monotonic()
                record_exit(self.exit_lock, rank, rank.popen.wait(), mono)
            else:
                record_exit(self.exit_lock, rank, wait_status(info), time.monotonic())
            # Its last output before its exit (the pumps may wait while the
            # launcher holds output): here, so the supervision loop never waits.
            for t in rank.readers:
                t.join(timeout=0.5)
        except BaseException as exc:  # noqa: BLE001 - the host fails; _reap polls the exit
            self._thread_failed(exc)  # queued before "exit": handled first
        rank.settled = True
        self.events.put("exit")

    def _agent_vars(self, rank: int) -> dict[str, str]:
        return {procs.JOB_MARKER: self.marker,
                "DSRUN_ERROR_FILE": os.path.join(self.tmpdir, f"rank_{rank}.json"),
                stackdump.STACK_FILE_VAR: os.path.join(self.tmpdir, f"stack_{rank}.txt"),
                MARKED_VAR: marked_file(self.tmpdir, rank),
                deathsig.AGENT_PID_VAR: str(os.getpid())}

    def _spawn(self, spec: dict[str, Any], log: IO[str] | None = None) -> bool:
        agent_vars = self._agent_vars(spec["rank"])
        env = apply_layers(spec["env"], login_environ(), self.payload.get("env", {}), agent_vars,
                           self.payload.get("env_files", ()))
        argv: list[str] = list(spec["argv"])
        try:
            argv = rank_argv(spec)
            popen = subprocess.Popen(
                argv, env=env, cwd=self.payload.get("cwd") or None,
                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                start_new_session=True,
            )
        except OSError as exc:
            self.failed = True
            self.emit({"ev": "exit", "rank": spec["rank"], "code": 127, "signal": None,
                       "time": time.time(), "age": 0.0, "during_stop": self.job.stopping,
                       "error": {"message": start_error(spec["argv"][0], exc, argv, env)},
                       "tail": []})
            self._begin_stop(failure=True)
            return False
        leader = procs.Leader.of(popen.pid)  # not reaped yet: still this process
        rank = Rank(spec["rank"], spec["local_rank"], popen, leader,
                    agent_vars["DSRUN_ERROR_FILE"], agent_vars[stackdump.STACK_FILE_VAR])
        rank.log = log
        # From here the teardown stops it, whatever fails next (_crashed).
        self.ranks.append(rank)
        if self.guard is not None and leader is not None:
            self.guard.watch(leader)
        rank.shm_name = deepspeed_shm_name(env, rank.rank)
        # Only dsrun's runtime opens the job's store there (--no_python: the
        # port may be a program's own, not a TCPStore)
        self.stores[rank.rank] = store_address(env) if spec.get("runtime", True) else None
        self.emit({"ev": "started", "rank": rank.rank, "pid": popen.pid})
        return True

    # -- supervision ----------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with held_signals():  # a failure dequeued is handled, or stays queued
                try:
                    event = self.events.get(timeout=0.05)
                except queue.Empty:
                    event = None
                if isinstance(event, tuple):  # a failure off the main thread: the host fails
                    self._failed_off_main(*event)
                    continue
            if event == "kill" or self.hurried or (event == "eof" and self.job.stopping):
                # Nobody waits for the grace any more: the launcher (or this
                # agent) was signalled twice, or went away while the job was
                # stopping.
                self._begin_stop()
                self.job.hurry()
            elif event == "stop":
                self._begin_stop(self.stop_signal, failure=self.stop_failure)
            elif event == "eof" or self.link.lost():
                self._begin_stop()
            self._forward_pending()
            self._reap()
            now = time.monotonic()
            if now >= self.next_check:
                self.next_check = now + 0.5
                self._check_guard()
            self.job.kill_overdue(self.ranks)
            if all(r.reported for r in self.ranks) and not self._late_failures():
                return

    def _failed_off_main(self, what: str, detail: Any) -> None:
        if what == "crash":
            self._crashed(detail)
        else:
            self._fail(detail)

    def _late_failures(self) -> bool:
        """Failures of threads queued behind the last exit: never lost."""
        found = False
        while True:
            with held_signals():  # as in _loop
                try:
                    event = self.events.get_nowait()
                except queue.Empty:
                    return found
                if isinstance(event, tuple):
                    self._failed_off_main(*event)
                    found = True

    def _check_guard(self) -> None:
        """Housekeeping (agent_stop.py); fail if the guard died."""
        how = self.job.check_children(self.ranks)
        if how is not None and not self.job.stopping and self.guard is not None:
            self._fail(f"its guard process (pid {self.guard.pid}) {how}: without it the "
                       f"ranks would outlive a killed agent, so the job is stopped")

    def _begin_stop(self, sig: signal.Signals = signal.SIGTERM, failure: bool = False) -> None:
        """Stop every rank; ``failure``: a failure began it, so the ranks get
        agent_stop.FAILURE_GRACE at most."""
        if not self.job.stopping:
            poll_exits(self.exit_lock, self.ranks)  # ranks dead by now did not die of this stop
        self.job.begin(self.ranks, sig, failure)

    def _reap(self) -> None:
        for rank in self.ranks:
            if rank.reported or not rank.settled:
                continue
            if rank.status is None:  # its wait thread failed: poll for the exit
                poll_exits(self.exit_lock, self.ranks)
                if rank.status is None:
                    continue
            with held_signals():  # reported and told, or neither (agent_hold.py)
                rank.reported = True
                self._report_exit(rank)

    def _report_exit(self, rank: Rank) -> None:
        error = own_error(rank, read_error_file(rank.error_file))
        event = exit_event(rank, error, self.job.stopping, self.job.stop_mono, self.signalled)
        self.emit(event)
        if not event["during_stop"]:  # its peers may wait for it (agent_marks.py)
            mark_if_unmarked(self.stores.get(rank.rank), self.tmpdir, rank.rank, rank.status)
        if rank.status != 0:
            if error is not None:
                self.output.log_error(rank, error)
            self.failed = True
            self.killed_outside |= not event["during_stop"] and \
                stop_signal_of(rank.status) is not None
            # Killed by a stop signal from outside: most likely one sent to
            # the whole job, whose other ranks may be saving (whole grace).
            self._begin_stop(failure=event["during_stop"] or stop_signal_of(rank.status) is None)

    def _finish(self) -> dict[str, Any]:
        """Make sure nothing of the job is left on this host (agent_stop.py);
        the ``done`` event's facts."""
        facts = self.job.finish(self.ranks, lambda: self.hurried)
        if self.job.line is not None:  # as a line of the agent's own (rank -1: AGENT_LINE)
            self.emit({"ev": "out", "rank": -1, "fd": 2, "lines": [self.job.line]}, False)
        for rank in self.ranks:
            self.output.close_log(rank)  # never raises: a full disk must not stop this
        if self.guard is not None:
            self.guard.done()
        remove_tmpdir(self.tmpdir)
        for rank in self.ranks:
            remove_own_shm(rank.shm_name)
        wait_for_marks()  # its process may end right after done (agent_marks.py)
        return facts


def main(argv: list[str] | None = None) -> int:
    _open_std_fds()
    args = sys.argv[1:] if argv is None else argv
    connect = "--connect" in args
    for sig in STOP_SIGNALS:
        signal.signal(sig, raise_stop)
    agent_forward.install()  # SIGUSR1/2 never end the agent (its ranks would die with it)
    # Orphans of the job's processes become the agent's (procs.py), before
    # any rank exists.
    subreaper = procs.become_subreaper()
    guard = Guard()  # before any thread exists: forking is safe only then
    try:
        try:
            link = (connect_link() if connect else Link(0, sys.stdout.buffer)).start()
            payload = read_payload(link)
        except Stop:
            return 0
        except (ConnectFailed, ValueError) as exc:
            sys.stderr.write(f"{exc}\n")
            return 3
        if not payload:  # told to exit before the start (an empty line: a broken launcher)
            stop_raising()
            link.drain(2.0)
            return 2 if payload == {} and not connect else 0
        code = Agent(payload, link, guard, subreaper).run()  # signals no longer raise after
        # With heartbeats a launcher that stops reading is found lost, so the
        # output held back at the end is not cut at a fixed time.
        if not link.drain(None if link.timeout > 0 else 5.0):
            _exit_now(0 if connect else code)
    finally:
        stop_raising()
        guard.done()
    # Under mpirun/srun a non-zero exit makes the tool abort the job and print
    # its own report; the launcher already knows the ranks' codes and stops
    # the job itself, so the agent exits 0 once it has done its work.
    return 0 if connect else code


if __name__ == "__main__":
    sys.exit(main())
