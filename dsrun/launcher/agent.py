"""The node agent: starts this host's ranks, streams their output, tears down.

One agent runs per host and attempt (``python -m dsrun.launcher.agent``),
started by a backend locally or over SSH, and talks to the launcher over
its stdin/stdout. Under mpirun and srun one agent runs per rank
(``python -m dsrun.launcher.agent --connect``): it connects back to the
launcher (callback.py) and talks over that connection instead; the rank it
starts inherits the MPI/Slurm variables, so MPI works in the rank. Either
way the agent may first answer ``probe`` commands (host facts, master port;
see protocol.py), then reads its part of the plan from the next line and
reports events. End of input before the plan means "exit, nothing was
started". Guarantees:

- every rank runs in its own session/process group, with the parent-death
  signal set, so it dies with the agent;
- the first rank to fail stops the others: SIGTERM to each group, then
  SIGKILL after ``kill_grace`` seconds;
- a stop command, end of input (launcher, SSH channel or connection gone)
  or a signal to the agent stops every rank the same way;
- before ``done`` is sent every process of the job on this host is gone,
  including descendants that left their group (found by the job marker);
- if the agent itself is SIGKILLed, its guard process kills the job.
"""

from __future__ import annotations

import collections
import ctypes
import json
import os
import queue
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import IO, Any

from dsrun.launcher import callback, netinfo, procs, protocol
from dsrun.launcher.rankenv import RankEnv, materialize

TAIL_LINES = 20
_PR_SET_PDEATHSIG = 1


class Stop(Exception):
    """Raised by the agent's signal handlers."""


def _raise_stop(signum: int, frame: object) -> None:
    raise Stop(signal.Signals(signum).name)


def _die_with_parent(parent: int):
    """preexec_fn: SIGKILL this rank when the agent dies (Linux only)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
    except OSError:
        libc = None

    def preexec() -> None:
        if libc is not None:
            libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent:  # the agent died before prctl took effect
            os._exit(137)

    return preexec


class Link:
    """The agent's channel to the launcher: raw reads from ``fd``, lines to ``out``."""

    def __init__(self, fd: int, out: IO[bytes], sock: socket.socket | None = None) -> None:
        self.fd = fd
        self.out = out
        self.sock = sock  # held: the fd is the socket's for as long as the agent runs

    def read_line(self) -> bytes:
        """One line, read byte-wise so nothing after it is consumed."""
        buf = bytearray()
        while True:
            try:
                b = os.read(self.fd, 1)
            except OSError:
                b = b""
            if not b or b == b"\n":
                return bytes(buf)
            buf += b


@dataclass
class Rank:
    rank: int
    local_rank: int
    popen: subprocess.Popen
    error_file: str
    tail: collections.deque = field(default_factory=lambda: collections.deque(maxlen=TAIL_LINES))
    readers: list[threading.Thread] = field(default_factory=list)
    log: IO[str] | None = None
    reported: bool = False
    exit_time: float = 0.0


class Agent:
    def __init__(self, payload: dict[str, Any], link: Link) -> None:
        self.payload = payload
        self.job_id: str = payload["job_id"]
        # Marks this agent's processes for teardown. Per agent, not per job:
        # hosts may share a PID namespace (containers with host PIDs, the
        # simulated cluster), and one agent must never stop another's ranks.
        self.marker = f"{self.job_id}.{uuid.uuid4().hex[:12]}"
        self.grace = float(payload.get("kill_grace", 5.0))
        self.link = link
        self.out = link.out
        self.lock = threading.Lock()
        self.events: queue.Queue[str] = queue.Queue()
        self.ranks: list[Rank] = []
        self.pgids: list[int] = []
        self.stopping = False
        self.hard_killed = False
        self.deadline = 0.0
        self.stop_time = float("inf")  # wall clock when stopping began
        self.failed = False
        self.guard: subprocess.Popen | None = None
        self.tmpdir = tempfile.mkdtemp(prefix=f"dsrun-{self.job_id[:8]}-")

    # -- output -------------------------------------------------------------
    def emit(self, obj: dict[str, Any]) -> None:
        with self.lock:
            try:
                protocol.write(self.out, obj)
            except (BrokenPipeError, ValueError, OSError):
                self.events.put("eof")  # nobody listens any more: stop

    # -- lifecycle ------------------------------------------------------------
    def run(self) -> int:
        try:
            try:
                self._start()
                self._loop()
            except Stop:
                self._begin_stop()
                self._loop()
        finally:
            killed = self._finish()
            self.emit({"ev": "done", "killed": killed})
        return 1 if self.failed else 0

    def _start(self) -> None:
        self.emit({"ev": "hello", "host": socket.gethostname(), "pid": os.getpid()})
        self.guard = subprocess.Popen(
            [sys.executable, "-m", "dsrun.launcher.guard", self.marker],
            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, start_new_session=True,
        )
        for spec in self.payload["ranks"]:
            self._spawn(spec)
        for rank in self.ranks:
            self._start_readers(rank)
            threading.Thread(target=self._wait_rank, args=(rank,), daemon=True).start()
        threading.Thread(target=self._read_commands, daemon=True).start()

    def _wait_rank(self, rank: Rank) -> None:
        # A thread per rank gives each exit its own timestamp: which rank
        # failed *first* decides the root cause, and polling would blur it.
        rank.popen.wait()
        rank.exit_time = time.time()
        self.events.put("exit")

    def _rank_env(self, spec: dict[str, Any]) -> dict[str, str]:
        """The rank's environment: rankenv's layers over this agent's own."""
        error_file = os.path.join(self.tmpdir, f"rank_{spec['rank']}.json")
        return materialize(RankEnv.from_json(spec["env"]), os.environ,
                           self.payload.get("env", {}),
                           {procs.JOB_MARKER: self.marker, "DSRUN_ERROR_FILE": error_file})

    def _spawn(self, spec: dict[str, Any]) -> None:
        env = self._rank_env(spec)
        try:
            popen = subprocess.Popen(
                spec["argv"], env=env, cwd=self.payload.get("cwd") or None,
                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                start_new_session=True, preexec_fn=_die_with_parent(os.getpid()),
            )
        except OSError as exc:
            self.failed = True
            self.emit({"ev": "exit", "rank": spec["rank"], "code": 127, "signal": None,
                       "time": time.time(), "during_stop": self.stopping,
                       "error": {"message": f"cannot start {spec['argv'][0]}: {exc.strerror}"},
                       "tail": []})
            self._begin_stop()
            return
        self.pgids.append(popen.pid)
        if self.guard is not None and self.guard.stdin is not None:
            self.guard.stdin.write(f"{popen.pid}\n".encode())
            self.guard.stdin.flush()
        rank = Rank(spec["rank"], spec["local_rank"], popen, env["DSRUN_ERROR_FILE"])
        rank.log = self._open_log(rank.rank)
        self.ranks.append(rank)
        self.emit({"ev": "started", "rank": rank.rank, "pid": popen.pid})

    def _open_log(self, rank: int) -> IO[str] | None:
        log_dir = self.payload.get("log_dir")
        if not log_dir:
            return None
        os.makedirs(log_dir, exist_ok=True)
        log = open(os.path.join(log_dir, f"rank_{rank}.log"), "a", encoding="utf-8")
        log.write(f"# dsrun job {self.job_id} restart {self.payload.get('restart_count', 0)} "
                  f"host {socket.gethostname()} {time.strftime('%Y-%m-%d %H:%M:%S')}\n")
        return log

    def _start_readers(self, rank: Rank) -> None:
        for fd, stream in ((1, rank.popen.stdout), (2, rank.popen.stderr)):
            t = threading.Thread(target=self._pump, args=(rank, fd, stream), daemon=True)
            t.start()
            rank.readers.append(t)

    def _pump(self, rank: Rank, fd: int, stream: IO[bytes]) -> None:
        for raw in iter(stream.readline, b""):
            line = raw.decode("utf-8", "replace").rstrip("\n")
            rank.tail.append(line)
            if rank.log is not None:
                with self.lock:
                    rank.log.write(line + "\n")
                    rank.log.flush()
            self.emit({"ev": "out", "rank": rank.rank, "fd": fd, "line": line})
        stream.close()

    def _read_commands(self) -> None:
        # Raw reads on the link's fd: a daemon thread blocked inside a
        # buffered reader would hold its lock at interpreter shutdown.
        pending = b""
        while True:
            try:
                chunk = os.read(self.link.fd, 65536)
            except OSError:
                chunk = b""
            if not chunk:
                break
            pending += chunk
            *lines, pending = pending.split(b"\n")
            for line in lines:
                try:
                    command = protocol.decode(line).get("cmd")
                except ValueError:
                    continue
                handler = self.commands.get(str(command))
                if handler is not None:  # unknown commands: from a newer launcher
                    handler()
        self.events.put("eof")

    @property
    def commands(self) -> dict[str, Any]:
        """Launcher commands (protocol.COMMANDS) -> what the agent does."""
        return {"stop": lambda: self.events.put("stop")}

    # -- supervision ----------------------------------------------------------
    def _loop(self) -> None:
        while True:
            try:
                event = self.events.get(timeout=0.05)
            except queue.Empty:
                event = None
            if event in ("stop", "eof"):
                self._begin_stop()
            self._reap()
            if self.stopping and not self.hard_killed and time.monotonic() >= self.deadline:
                procs.signal_groups(self._live_pgids(), signal.SIGKILL)
                self.hard_killed = True
            if all(r.reported for r in self.ranks):
                return

    def _live_pgids(self) -> list[int]:
        return [r.popen.pid for r in self.ranks if r.popen.returncode is None]

    def _begin_stop(self) -> None:
        if self.stopping:
            return
        self.stopping = True
        self.stop_time = time.time()
        self.deadline = time.monotonic() + self.grace
        procs.signal_job(self.pgids, self.marker, signal.SIGTERM)

    def _reap(self) -> None:
        for rank in self.ranks:
            if rank.reported or rank.popen.returncode is None or not rank.exit_time:
                continue
            rank.reported = True
            for t in rank.readers:
                t.join(timeout=0.5)
            code = rank.popen.returncode
            failed = code != 0
            error = _read_error(rank.error_file)
            # The rank's own record is stamped when the error was raised,
            # before the process finished exiting: the earliest evidence.
            when = min(rank.exit_time, float((error or {}).get("time", rank.exit_time)))
            during_stop = self.stopping and when >= self.stop_time
            if code < 0 and error is not None and when < self.stop_time:
                # It was already failing on its own (the record says how) when
                # our SIGTERM caught it in its exit path: report its own code.
                code = int(error.get("exit_code", 1))
            self.emit({
                "ev": "exit", "rank": rank.rank,
                "code": code if code >= 0 else None,
                "signal": -code if code < 0 else None,
                "time": when, "during_stop": during_stop,
                "error": error, "tail": list(rank.tail),
            })
            if failed:
                self.failed = True
                self._begin_stop()

    def _finish(self) -> int:
        """Make sure nothing of the job is left on this host; return #SIGKILLed."""
        deadline = self.deadline if self.stopping else None
        killed = procs.stop_job(self.pgids, self.marker, self.grace,
                                already_termed=self.stopping, deadline=deadline)
        for rank in self.ranks:
            if rank.popen.poll() is None:  # only after a second signal
                rank.popen.kill()
                rank.popen.wait()
            if rank.log is not None:
                rank.log.close()
        if self.guard is not None and self.guard.stdin is not None:
            try:
                self.guard.stdin.write(b"done\n")
                self.guard.stdin.close()
            except OSError:
                pass
            self.guard.wait()
        shutil.rmtree(self.tmpdir, ignore_errors=True)
        return killed


def _read_error(path: str) -> dict[str, Any] | None:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _read_payload(link: Link) -> dict[str, Any] | None:
    """Answer probes until the start payload arrives; None: told to exit."""
    held: netinfo.HeldPort | None = None
    probed = False
    try:
        while True:
            line = link.read_line()
            if not line:
                return None if probed else {}
            msg = protocol.decode(line)
            cmd = msg.get("cmd")
            if cmd is None:
                return msg
            if cmd != "probe":  # "stop" before the start: nothing to stop
                return None
            facts, port = netinfo.probe_reply(msg)
            if port is not None:
                if held is not None:
                    held.close()
                held = port
            try:
                protocol.write(link.out, facts)
            except OSError:  # the launcher is gone
                return None
            probed = True
    finally:
        # The master port is held until now: release it for rank 0's store.
        if held is not None:
            held.close()


def _connect_link() -> Link:
    """Connect back to the launcher (agents started by mpirun/srun)."""
    who = callback.identity(os.environ)
    try:
        sock = callback.agent_connect(os.environ, who)
    except (OSError, ValueError, callback.HandshakeError) as exc:
        raise ConnectFailed(f"dsrun agent of rank {who.rank} on {socket.gethostname()}: "
                            f"cannot connect to the launcher: {exc}") from None
    return Link(sock.fileno(), sock.makefile("wb"), sock)


class ConnectFailed(Exception):
    """The agent could not reach the launcher (message for stderr)."""


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    connect = "--connect" in args
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, _raise_stop)
    try:
        link = _connect_link() if connect else Link(0, sys.stdout.buffer)
        payload = _read_payload(link)
    except Stop:
        return 0
    except (ConnectFailed, ValueError) as exc:
        sys.stderr.write(f"{exc}\n")
        return 3
    if not payload:  # told to exit before the start (an empty line: a broken launcher)
        return 2 if payload == {} and not connect else 0
    code = Agent(payload, link).run()
    # Under mpirun/srun a non-zero exit makes the tool abort the job and print
    # its own report; the launcher already knows the ranks' codes and stops
    # the job itself, so the agent exits 0 once it has done its work.
    return 0 if connect else code


if __name__ == "__main__":
    sys.exit(main())
