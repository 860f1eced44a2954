"""The node agent's part in telling ranks that a peer has left
(runtime/exitmark.py): the exit mark of a rank that could not post its own.

A rank posts its exit mark from its own exit path (the bootstrap's
``finally``), so one that leaves without running Python - ``os._exit``, a
signal, SIGKILL, a crash - posts nothing, and a peer waiting for it in a
checkpoint call would wait the whole ``checkpoint.timeout``. The agent
sees every exit: for a rank of a job with a store (a process group of more
than one rank, master address and port and the dsrun job id known) that
did not post its mark (exitmark.py writes :data:`exitmark.MARKED_VAR`'s
file once it has), it posts one for it, ``{"status", "during": null,
"signal", "by": "agent"}``, the way the rank would have (the rank's key,
then the count). When the key is there already the rank's own ``set``
reached the store but its count may not have (the rank gives up after
exitmark.MARK_WAIT_S): the agent adds to the count then, which costs the
waiters one more read of the keys at most. The rank is gone by then, so
nobody else posts for it.

The store is torch's TCPStore, hosted by rank 0; the agent does not import
torch (one agent starts per host and attempt, all at once), so
:class:`StoreClient` speaks the store's wire protocol for the five queries
it needs (validate, check, get, set, add: torch's TCPStoreBackend.hpp, the
same for the libuv and the classic server). Before it writes anything the
agent reads the store's ``dsrun/job_id`` (rendezvous.JOB_KEY): a port given
to two jobs at once may be held by another job's store, or by a program
that is no store at all, and neither must get this job's marks. Posting
runs on a thread of its own with short timeouts: a store that is gone
(rank 0 exited) or does not answer costs the agent nothing, and the peers
are no worse off than before. Those threads are waited for, a bounded time
(:func:`wait_for_marks`), before the agent's process ends, which would cut
them short: the rank that left may have been its host's last. Kept to the
standard library.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import signal
import socket
import struct
import threading
import time
from collections.abc import Mapping
from typing import NamedTuple

from dsrun.runtime.exitmark import COUNT_KEY, MARKED_VAR, PREFIX

#: Seconds the agent gives rank 0's store to accept and answer (each step).
STORE_WAIT_S = 2.0
#: The longest the agent waits for its posting threads in all (wait_for_marks).
JOIN_WAIT_S = STORE_WAIT_S
#: TCPStore's wire protocol (torch/csrc/distributed/c10d/TCPStoreBackend.hpp).
_VALIDATE, _SET, _GET, _ADD, _CHECK = 0, 1, 3, 4, 5
_MAGIC = 0x3C85F7CE
_READY = 0
#: TCPStore puts this before every key it sends (TCPStore::keyPrefix_).
_KEY_PREFIX = "/"
#: The key holding the id of the job whose rank 0 hosts the store
#: (runtime/rendezvous.JOB_KEY; not imported: that module is torch's side).
JOB_KEY = "dsrun/job_id"
#: Longer than any job id: a reply claiming more is not a store's.
_MAX_ID_BYTES = 256
#: What :func:`post_mark` did.
POSTED, COUNTED, REFUSED, UNREACHABLE = "posted", "counted", "refused", "unreachable"

log = logging.getLogger("dsrun.launcher.agent")
_posting: list[threading.Thread] = []  # mark_if_unmarked's threads, for wait_for_marks
_posting_lock = threading.Lock()
_waits_at_exit = False


class StoreAddress(NamedTuple):
    """Where a rank's job store is, and the job whose it must be."""

    addr: str
    port: int
    job_id: str


def store_address(env: Mapping[str, str]) -> StoreAddress | None:
    """Rank 0's store (MASTER_ADDR, MASTER_PORT) in a rank's environment,
    with the job id (DSRUN_JOB_ID) it must hold, when its job has one the
    ranks post exit marks to; else None."""
    if env.get("DSRUN_DIST_BACKEND", "") == "none":
        return None
    try:
        world, port = int(env.get("WORLD_SIZE", "1")), int(env.get("MASTER_PORT", ""))
    except ValueError:
        return None
    addr, job_id = env.get("MASTER_ADDR", ""), env.get("DSRUN_JOB_ID", "")
    if world > 1 and addr and job_id and 0 < port < 65536:
        return StoreAddress(addr, port, job_id)
    return None


def marked_file(tmpdir: str, rank: int) -> str:
    """The file the rank's exit path writes once its mark is posted."""
    return os.path.join(tmpdir, f"marked_{rank}")


class StoreClient:
    """A connection to a TCPStore speaking just what an exit mark needs."""

    def __init__(self, addr: str, port: int, timeout: float = STORE_WAIT_S) -> None:
        self.sock = socket.create_connection((addr, port), timeout=timeout)
        self._send(struct.pack("=BI", _VALIDATE, _MAGIC))

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> StoreClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def check(self, key: str) -> bool:
        """Whether ``key`` is set."""
        self._send(struct.pack("=BQ", _CHECK, 1) + _string(key))
        return self._recv(1)[0] == _READY

    def get(self, key: str, limit: int = _MAX_ID_BYTES) -> bytes:
        """``key``'s value, which must be set (check first: the classic
        server drops the connection on a missing key) and at most ``limit``
        bytes long (longer: ValueError, the listener is not a store)."""
        self._send(struct.pack("=B", _GET) + _string(key))
        size = int(struct.unpack("=Q", self._recv(8))[0])
        if size > limit:
            raise ValueError(f"a {size}-byte value for {key!r} (at most {limit} expected)")
        return self._recv(size)

    def set(self, key: str, value: bytes) -> None:
        self._send(struct.pack("=B", _SET) + _string(key) + struct.pack("=Q", len(value))
                   + value)

    def add(self, key: str, amount: int) -> int:
        self._send(struct.pack("=B", _ADD) + _string(key) + struct.pack("=q", amount))
        return int(struct.unpack("=q", self._recv(8))[0])

    def _send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def _recv(self, size: int) -> bytes:
        data = b""
        while len(data) < size:
            part = self.sock.recv(size - len(data))
            if not part:
                raise ConnectionError("the store closed the connection")
            data += part
        return data


def _string(key: str) -> bytes:
    raw = (_KEY_PREFIX + key).encode()
    return struct.pack("=Q", len(raw)) + raw


def mark_value(status: int) -> dict[str, object]:
    """The mark of a rank that ended with ``status`` (as Popen.returncode)."""
    if status < 0:
        try:
            name = signal.Signals(-status).name
        except ValueError:
            name = f"signal {-status}"
        return {"status": 128 - status, "during": None, "signal": name, "by": "agent"}
    return {"status": status, "during": None, "by": "agent"}


def _owner(client: StoreClient) -> str | None:
    """The job id the store holds; None when it holds none."""
    if not client.check(JOB_KEY):
        return None
    return client.get(JOB_KEY).decode(errors="replace")


def post_mark(store: StoreAddress, rank: int, status: int) -> str:
    """Post ``rank``'s exit mark, whose rank wrote no marked file; what was
    done: :data:`POSTED`; :data:`COUNTED` (its key was there, the count
    added to: module docstring); :data:`REFUSED` (not this job's store: the
    listener holds no or another job id, or does not answer as a store);
    :data:`UNREACHABLE` (rank 0 is gone or does not answer)."""
    key = f"{PREFIX}{rank}"
    where = f"{store.addr}:{store.port}"
    try:
        with StoreClient(store.addr, store.port) as client:
            owner = _owner(client)
            if owner != store.job_id:
                log.info("rank %d's exit mark not posted: the listener on %s is not job %s's "
                         "store (its dsrun/job_id: %s)", rank, where, store.job_id, owner)
                return REFUSED
            if client.check(key):
                client.add(COUNT_KEY, 1)
                return COUNTED
            client.set(key, json.dumps(mark_value(status)).encode())
            client.add(COUNT_KEY, 1)
            return POSTED
    except ValueError as exc:  # a reply no store gives (or an address idna rejects)
        log.info("rank %d's exit mark not posted to %s: %s", rank, where, exc)
        return REFUSED
    except OSError:  # rank 0 (its store) is gone or does not answer: nobody waits
        return UNREACHABLE


def mark_if_unmarked(store: StoreAddress | None, tmpdir: str, rank: int,
                     status: int) -> threading.Thread | None:
    """Post ``rank``'s mark on a thread of its own when the rank did not
    (module docstring); the thread, or None when there is nothing to do."""
    if store is None or os.path.exists(marked_file(tmpdir, rank)):
        return None
    thread = threading.Thread(target=post_mark, args=(store, rank, status),
                              name=f"dsrun-mark-{rank}", daemon=True)
    global _waits_at_exit
    with _posting_lock:
        if not _waits_at_exit:  # the agent's process waits for them before it ends
            atexit.register(wait_for_marks)
            _waits_at_exit = True
        _posting.append(thread)
    thread.start()
    return thread


def wait_for_marks(timeout: float = JOIN_WAIT_S) -> bool:
    """Wait, ``timeout`` seconds in all at most, for the marks being posted
    (the threads end with the agent's process); whether all are done."""
    end = time.monotonic() + timeout
    with _posting_lock:
        threads = list(_posting)
    for thread in threads:
        thread.join(max(0.0, end - time.monotonic()))
    with _posting_lock:
        _posting[:] = [t for t in _posting if t.is_alive()]
        return not _posting


__all__ = ["COUNTED", "MARKED_VAR", "POSTED", "REFUSED", "UNREACHABLE", "StoreAddress",
           "StoreClient", "mark_if_unmarked", "marked_file", "post_mark", "store_address",
           "wait_for_marks"]
