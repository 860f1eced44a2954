"""The node agent's part in telling ranks that a peer has left
(runtime/exitmark.py): the exit mark of a rank that could not post its own.

A rank posts its exit mark from its own exit path (the bootstrap's
``finally``), so one that leaves without running Python - ``os._exit``, a
signal, SIGKILL, a crash - posts nothing, and a peer waiting for it in a
checkpoint call would wait the whole ``checkpoint.timeout``. The agent
sees every exit: for a rank of a job with a store (a process group of more
than one rank, master address and port known) that did not post its mark
(exitmark.py writes :data:`exitmark.MARKED_VAR`'s file once it has), it
posts one for it, ``{"status", "during": null, "signal", "by": "agent"}``,
the way the rank would have (the rank's key, then the count), unless the
key is there already. The rank is gone by then, so nobody else posts for it.

The store is torch's TCPStore, hosted by rank 0; the agent does not import
torch (one agent starts per host and attempt, all at once), so
:class:`StoreClient` speaks the store's wire protocol for the four queries
it needs (validate, check, set, add: torch's TCPStoreBackend.hpp, the same
for the libuv and the classic server). Posting runs on a thread of its
own with short timeouts: a store that is gone (rank 0 exited) or does not
answer costs the agent nothing, and the peers are no worse off than before.
Kept to the standard library.
"""

from __future__ import annotations

import json
import os
import socket
import struct
import threading
from collections.abc import Mapping

from dsrun.runtime.exitmark import COUNT_KEY, MARKED_VAR, PREFIX

#: Seconds the agent gives rank 0's store to accept and answer (each step).
STORE_WAIT_S = 2.0
#: TCPStore's wire protocol (torch/csrc/distributed/c10d/TCPStoreBackend.hpp).
_VALIDATE, _SET, _ADD, _CHECK = 0, 1, 4, 5
_MAGIC = 0x3C85F7CE
_READY = 0
#: TCPStore puts this before every key it sends (TCPStore::keyPrefix_).
_KEY_PREFIX = "/"


def store_address(env: Mapping[str, str]) -> tuple[str, int] | None:
    """Rank 0's store (MASTER_ADDR, MASTER_PORT) in a rank's environment,
    when its job has one the ranks post exit marks to; else None."""
    if env.get("DSRUN_DIST_BACKEND", "") == "none":
        return None
    try:
        world, port = int(env.get("WORLD_SIZE", "1")), int(env.get("MASTER_PORT", ""))
    except ValueError:
        return None
    addr = env.get("MASTER_ADDR", "")
    return (addr, port) if world > 1 and addr and 0 < port < 65536 else None


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
    import signal

    if status < 0:
        try:
            name = signal.Signals(-status).name
        except ValueError:
            name = f"signal {-status}"
        return {"status": 128 - status, "during": None, "signal": name, "by": "agent"}
    return {"status": status, "during": None, "by": "agent"}


def post_mark(store: tuple[str, int], rank: int, status: int) -> bool:
    """Post ``rank``'s exit mark unless it is there; whether this call posted it."""
    key = f"{PREFIX}{rank}"
    try:
        with StoreClient(*store) as client:
            if client.check(key):
                return False
            client.set(key, json.dumps(mark_value(status)).encode())
            client.add(COUNT_KEY, 1)
            return True
    except OSError:  # rank 0 (its store) is gone or does not answer: nobody waits
        return False


def mark_if_unmarked(store: tuple[str, int] | None, tmpdir: str, rank: int,
                     status: int) -> threading.Thread | None:
    """Post ``rank``'s mark on a thread of its own when the rank did not
    (module docstring); the thread, or None when there is nothing to do."""
    if store is None or os.path.exists(marked_file(tmpdir, rank)):
        return None
    thread = threading.Thread(target=post_mark, args=(store, rank, status),
                              name=f"dsrun-mark-{rank}", daemon=True)
    thread.start()
    return thread


__all__ = ["MARKED_VAR", "StoreClient", "mark_if_unmarked", "marked_file", "post_mark",
           "store_address"]
