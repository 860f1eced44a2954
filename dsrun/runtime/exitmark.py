"""Telling the other ranks that this rank has left, so they stop waiting for it.

A rank whose script ends (it returns, calls ``sys.exit``, raises) while
the others still expect it in a checkpoint call would leave them waiting
the whole ``checkpoint.timeout``: the store they wait on is rank 0's,
which does not notice a peer going away. So the bootstrap's exit path
(bootstrap.py) calls :func:`mark_exited`, which sets ``dsrun/exited/RANK``
to ``{"status": ..., "during": ...}`` (``during``: the checkpoint call the
exit came through, e.g. ``"engine.save_checkpoint()"``, else null) and
then adds 1 to ``dsrun/exited/count``, in the job's store.
:class:`ExitWatch` is how a waiter (checkpoint/coord.py) reads them between
short waits: one store call per poll (the count), the keys only once the
count has grown. Nothing of this runs per training step.

The store is the dsrun job's own (rendezvous.py; it outlives a script's
``destroy_process_group``), else the default group's. A rank that ends
without running Python (``os._exit``, a signal, a crash) sets nothing
itself: its node agent, which sees every exit, posts the mark for it
(launcher/agent_marks.py; ``"by": "agent"``, with ``signal`` for a rank
killed by one, and only into a store holding the job's id), unless the
file :data:`MARKED_VAR` names exists - the rank writes it once its own
mark is posted (its key set and counted; a key set but not known to be
counted is counted by the agent). When rank
0 itself leaves, the store goes with it and a waiter's store calls fail:
the waiter names rank 0 (:data:`STORE_GONE`). A rank that exits after
rank 0 posts nothing: it first opens a plain connection to the store's
port (:func:`store_reachable`, which logs nothing), since a store call
that finds the server gone has torch write a C++ stack trace to stderr.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
import traceback
from typing import Any, Optional

PREFIX = "dsrun/exited/"
COUNT_KEY = PREFIX + "count"
#: The longest an exiting rank spends setting its key (a store that no
#: longer answers must not hold the exit up).
MARK_WAIT_S = 2.0
#: How long :func:`store_reachable` waits for the store's port to answer.
PROBE_WAIT_S = 0.2
#: The dsrun entry points a checkpoint call of the script goes through,
#: by function name, and how an error names them.
CALLS = {"save_checkpoint": "engine.save_checkpoint()",
         "load_checkpoint": "engine.load_checkpoint()",
         "save_16bit_model": "engine.save_16bit_model()"}
#: The variable (set by the node agent) naming the file a rank writes once
#: its mark is posted: the agent then posts none for it.
MARKED_VAR = "DSRUN_EXIT_MARKED"
#: What a waiter says when rank 0's store cannot be reached any more.
STORE_GONE = "rank 0 (which holds the job's store) exited or cannot be reached"
_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


def job_store() -> Any:
    """The store exit marks go to (module docstring); None without one."""
    rendezvous = sys.modules.get("dsrun.runtime.rendezvous")
    store = getattr(rendezvous, "current_store", lambda: None)()
    if store is not None:
        return store
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return None
    try:
        return dist.distributed_c10d._get_default_store()
    except (AttributeError, RuntimeError, ValueError):
        return None


def store_reachable(store: Any) -> bool:
    """False when the TCP store behind ``store`` refuses a plain connection
    (its host, rank 0, has exited): a store call would then fail, after
    torch logged a stack trace. True for a store with no address to try,
    and when the connection is merely slow (a busy host: the store call
    decides)."""
    while not hasattr(store, "port") and hasattr(store, "underlying_store"):
        store = store.underlying_store  # a PrefixStore
    host, port = getattr(store, "host", None), getattr(store, "port", None)
    if not host or not port:
        return True
    try:
        with socket.create_connection((host, port), timeout=PROBE_WAIT_S):
            return True
    except ConnectionRefusedError:
        return False
    except OSError:
        return True


def during(exc: Optional[BaseException]) -> Optional[str]:
    """The checkpoint call (:data:`CALLS`) that ``exc`` left through, or None."""
    if exc is None:
        return None
    for frame, _ in traceback.walk_tb(exc.__traceback__):
        name = frame.f_code.co_name
        if name in CALLS and os.path.abspath(frame.f_code.co_filename).startswith(_PACKAGE_DIR):
            return CALLS[name]
    return None


def mark_exited(rank: int, status: int, exc: Optional[BaseException] = None) -> bool:
    """Post this rank's exit (module docstring); False when no store took it
    within :data:`MARK_WAIT_S`."""
    store = job_store()
    if store is None or not store_reachable(store):
        return False
    value = json.dumps({"status": status, "during": during(exc)})
    done = threading.Event()

    def post() -> None:
        try:
            store.set(f"{PREFIX}{rank}", value)
            store.add(COUNT_KEY, 1)
            done.set()
        except Exception:  # noqa: BLE001 - the store host has gone: nobody waits any more
            pass

    # a thread: a store host that stopped answering would block the call
    # for the store's whole timeout; the rank is exiting either way
    thread = threading.Thread(target=post, name="dsrun-exit-mark", daemon=True)
    thread.start()
    thread.join(MARK_WAIT_S)
    if done.is_set():
        _tell_agent()
    return done.is_set()


def _tell_agent() -> None:
    """Write :data:`MARKED_VAR`'s file: the agent need not post a mark."""
    path = os.environ.get(MARKED_VAR)
    if path:
        try:
            with open(path, "w"):
                pass
        except OSError:  # the agent posts one too, unless it finds this one there
            pass


def describe_exit(rank: int, mark: dict[str, Any]) -> str:
    """``rank 1 exited (status 0)``; ``rank 1 exited (status 137: killed by
    SIGKILL)`` for a mark its agent posted for a rank a signal killed."""
    killed = f": killed by {mark['signal']}" if mark.get("signal") else ""
    return f"rank {rank} exited (status {mark.get('status')}{killed})"


class ExitWatch:
    """The exit marks of the ``world`` ranks, read between a waiter's short waits."""

    def __init__(self, store: Any, world: int) -> None:
        self.store, self.world = store, world
        self._count = 0
        self.exited: dict[int, dict[str, Any]] = {}

    def poll(self) -> dict[int, dict[str, Any]]:
        """The marks of the ranks that have exited, by rank. Raises the
        store's error when it cannot be reached (rank 0 has gone)."""
        count = int(self.store.add(COUNT_KEY, 0))
        if count > self._count:  # a rank's key is set before it counts itself
            for rank in range(self.world):
                key = f"{PREFIX}{rank}"
                if rank not in self.exited and self.store.check([key]):
                    self.exited[rank] = json.loads(self.store.get(key))
            self._count = count
        return dict(self.exited)
