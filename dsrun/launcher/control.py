"""A running launcher's control socket, and the client ``dsrun stack`` uses.

Each ``dsrun`` run listens on a Unix socket named after its job id (the
first :data:`ID_CHARS` characters, as dsrun shows it) in a directory only
its user can enter (:func:`socket_dir`:
``$XDG_RUNTIME_DIR/dsrun``, else ``/tmp/dsrun-UID``, mode 0700). One JSON
request line per connection:

- ``{"cmd": "info"}`` -> one line: job id, launcher pid, script, hosts,
  ranks, seconds running (answered by the server thread itself);
- ``{"cmd": "stack"}`` -> lines of text, ``[host:rank] ...``, the current
  Python stack of every running rank on every host, then end of stream.
  The request is handed to the supervisor (a queue), which asks every
  agent and streams the answers back (supervisor.py, stackdump.py).

A socket whose launcher is gone (SIGKILL) refuses connections; such stale
sockets are removed by the next launcher that starts (:func:`remove_stale`)
and by the client. The socket is removed when the launcher ends.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import queue
import socket
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from dsrun.errors import DsrunUsageError

SUFFIX = ".sock"
#: Characters of the job id in the socket's name (and in what dsrun prints).
ID_CHARS = 12
log = logging.getLogger("dsrun.launcher")


def socket_dir() -> str:
    """Where launchers' control sockets lie: the same for every shell of the
    user on this host, so ``dsrun stack`` finds a job whatever TMPDIR the job
    or the asking shell has (a batch system sets one per job): /tmp, not
    the temporary directory, unless /tmp cannot be written."""
    base = os.environ.get("XDG_RUNTIME_DIR")
    if base and os.path.isdir(base):
        return os.path.join(base, "dsrun")
    tmp = "/tmp"
    if not os.access(tmp, os.W_OK | os.X_OK):
        try:
            tmp = tempfile.gettempdir()
        except OSError:  # none usable: binding there fails, with the usual warning
            pass
    return os.path.join(tmp, f"dsrun-{os.getuid()}")


def _private_dir() -> str:
    path = socket_dir()
    os.makedirs(path, mode=0o700, exist_ok=True)
    st = os.stat(path)
    if st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise OSError(f"{path} is not private to this user")
    return path


@dataclass
class StackQuery:
    """A ``stack`` request waiting for the supervisor: where answers go."""

    write: Callable[[str], bool]  # one line; False when the client is gone
    close: Callable[[], None]


class ControlServer:
    """The launcher's end; ``info`` is a callable giving the job's facts."""

    def __init__(self, job_id: str, info: Callable[[], dict[str, Any]]) -> None:
        self.job_id = job_id
        self.info = info
        self.queries: queue.Queue[StackQuery] = queue.Queue()
        self.path: str | None = None
        self._sock: socket.socket | None = None

    def start(self) -> ControlServer:
        """Listen; a launcher that cannot (no writable directory) still runs."""
        path = os.path.join(socket_dir(), f"{self.job_id[:ID_CHARS]}{SUFFIX}")
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            _private_dir()
            remove_stale()
            sock.bind(path)
            sock.listen(16)
        except OSError as exc:
            sock.close()
            log.warning("no control socket at %s (dsrun stack cannot reach this job): %s",
                        path, exc)
            return self
        self.path, self._sock = path, sock
        threading.Thread(target=self._accept, daemon=True, name="dsrun-control").start()
        return self

    def _accept(self) -> None:
        assert self._sock is not None
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        conn.settimeout(5.0)
        try:
            request = json.loads(conn.makefile("rb").readline() or b"{}")
        except (OSError, ValueError):
            conn.close()
            return
        cmd = request.get("cmd") if isinstance(request, dict) else None
        if cmd == "info":
            with contextlib.suppress(OSError):
                conn.sendall((json.dumps(self.info()) + "\n").encode())
            conn.close()
        elif cmd == "stack":
            self.queries.put(StackQuery(lambda line: _send_line(conn, line), conn.close))
        else:
            conn.close()

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
        if self.path is not None:
            with contextlib.suppress(OSError):
                os.unlink(self.path)


def _send_line(conn: socket.socket, line: str) -> bool:
    try:
        conn.sendall((line + "\n").encode("utf-8", "replace"))
        return True
    except OSError:
        return False


# --------------------------------------------------------------------------
# the client side (``dsrun stack``)


def _request(path: str, cmd: str, timeout: float) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    try:
        sock.connect(path)
        sock.sendall((json.dumps({"cmd": cmd}) + "\n").encode())
    except OSError:
        sock.close()
        raise
    return sock


def _socket_paths() -> list[str]:
    directory = socket_dir()
    try:
        names = sorted(n for n in os.listdir(directory) if n.endswith(SUFFIX))
    except OSError:
        return []
    return [os.path.join(directory, name) for name in names]


def _unlink_if_refused(path: str, exc: OSError) -> bool:
    """Remove ``path`` when ``exc`` says nobody listens there (its
    launcher is gone); True if so."""
    if not isinstance(exc, ConnectionRefusedError):
        return False
    with contextlib.suppress(OSError):
        os.unlink(path)
    return True


def remove_stale() -> int:
    """Remove the sockets of this user's launchers that are gone (SIGKILL
    leaves them behind: nothing listens, a connection is refused); how
    many. A live launcher sees one empty connection, which it ignores."""
    removed = 0
    for path in _socket_paths():
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(1.0)
        try:
            sock.connect(path)
        except OSError as exc:
            removed += _unlink_if_refused(path, exc)
        finally:
            sock.close()
    return removed


def running_jobs() -> list[dict[str, Any]]:
    """``info`` of every dsrun job of this user running on this host."""
    jobs = []
    for path in _socket_paths():
        try:
            with _request(path, "info", 2.0) as sock:
                info = json.loads(sock.makefile("rb").readline())
        except OSError as exc:
            _unlink_if_refused(path, exc)
            continue
        except ValueError:
            continue
        info["socket"] = path
        jobs.append(info)
    return jobs


def choose_job(jobs: list[dict[str, Any]], wanted: str | None) -> dict[str, Any]:
    """The job ``wanted`` names (a job id or its prefix), or the only one."""
    if wanted is not None:
        matches = [j for j in jobs if str(j.get("job_id", "")).startswith(wanted)]
        if len(matches) == 1:
            return matches[0]
        what = "no running dsrun job" if not matches else f"{len(matches)} jobs"
        raise DsrunUsageError(f"{what} with an id starting {wanted!r}{_listing(jobs)}")
    if len(jobs) == 1:
        return jobs[0]
    if not jobs:
        raise DsrunUsageError(f"no running dsrun job of this user on this host (looked in "
                              f"{socket_dir()})")
    raise DsrunUsageError(f"{len(jobs)} dsrun jobs are running: name one{_listing(jobs)}")


def _listing(jobs: list[dict[str, Any]]) -> str:
    if not jobs:
        return ""
    rows = [f"  {j.get('job_id', '?')[:12]}  {j.get('script', '?')} on "
            f"{len(j.get('hosts', []))} host(s), {j.get('seconds', 0):.0f}s" for j in jobs]
    return ":\n" + "\n".join(rows)


#: how the launcher's answer to "stack" names hosts whose agents did not answer
NO_ANSWER = "dsrun: no stacks in time from "


def stream_stacks(path: str, write: Callable[[str], None], timeout: float = 30.0,
                  note: Callable[[str], None] | None = None) -> tuple[int, bool]:
    """Ask the launcher at ``path`` for every rank's stack; lines to
    ``write`` (a line saying some host did not answer to ``note``, default
    ``write``); (the number of stack lines received, whether every host
    answered)."""
    count, complete = 0, True
    deadline = time.monotonic() + timeout
    with _request(path, "stack", timeout) as sock:
        for raw in sock.makefile("rb"):
            line = raw.decode("utf-8", "replace").rstrip("\n")
            if line.startswith(NO_ANSWER):
                complete = False
                (note or write)(line)
            else:
                write(line)
                count += 1
            if time.monotonic() > deadline:
                complete = False
                break
    return count, complete
