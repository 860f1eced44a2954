"""What the node agent needs from the operating system: its stop signals,
a private temporary directory, wait statuses, rank error files and the
shared-memory segments DeepSpeed's CPU all-reduce leaves behind.

Kept to the standard library: every agent imports it at start-up.
"""

from __future__ import annotations

import json
import os
import signal
import threading
from collections.abc import Callable
from typing import Any

#: The signals that stop the agent.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


class Stop(Exception):
    """Raised by the agent's signal handlers."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = int(signum)


def raise_stop(signum: int, frame: object) -> None:
    raise Stop(signum)


def stop_raising(then: Callable[[], None] | None = None) -> None:
    """From now on the stop signals do not raise Stop: the teardown has
    begun and must run to its end. ``then`` runs on each one instead."""
    if threading.current_thread() is not threading.main_thread():
        return  # an agent driven by a test's thread: signals are not its own

    def on_signal(signum: int, frame: object) -> None:
        if then is not None:
            then()

    for sig in STOP_SIGNALS:
        signal.signal(sig, on_signal)


def hostname() -> str:
    return os.uname().nodename


def make_tmpdir(prefix: str) -> str:
    """A private directory for the ranks' error and stack files."""
    base = os.environ.get("TMPDIR") or "/tmp"
    while True:
        path = os.path.join(base, f"{prefix}{os.urandom(4).hex()}")
        try:
            os.mkdir(path, 0o700)
            return path
        except FileExistsError:
            continue


def remove_tmpdir(path: str) -> None:
    try:
        with os.scandir(path) as entries:
            for entry in entries:
                os.unlink(entry.path)
        os.rmdir(path)
    except OSError:
        pass


def deepspeed_shm_name(env: dict[str, str], rank: int) -> str:
    """The shared-memory segment DeepSpeed's CPU all-reduce creates for
    ``rank`` when every rank is on one host (its ``shm.cpp``: uid, master
    address and port, rank), and never removes: a job of dsrun's gets a new
    port each time, so the agent removes it when the job's processes are gone."""
    return (f"deepspeed_allreduce_buffer_{os.getuid()}_{env.get('MASTER_ADDR', '')}_"
            f"{env.get('MASTER_PORT', '')}_{rank}")


def remove_own_shm(name: str) -> None:
    path = os.path.join("/dev/shm", name)
    try:
        if name and "/" not in name and os.stat(path).st_uid == os.getuid():
            os.unlink(path)
    except OSError:
        pass


def wait_status(info: os.waitid_result) -> int:
    """As Popen.returncode: the exit code, or minus the signal's number."""
    return info.si_status if info.si_code == os.CLD_EXITED else -info.si_status


def read_error_file(path: str) -> dict[str, Any] | None:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):
        return None
