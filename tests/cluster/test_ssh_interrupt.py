"""A signal to dsrun while a host has not answered SSH yet.

A host whose sshd is stopped completes the TCP handshake (the kernel does)
but never sends its banner, so the connect to it waits up to
--ssh_timeout. Ctrl-C or SIGTERM then must end the launcher (and
``dsrun doctor``) at once and cleanly: no wait for the connect, no
traceback (a second Ctrl-C once printed the thread pool's at exit), and
nothing left on any host (the autouse leak check).
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO

import pytest
from simhosts import SimCluster
from sshjobs import BEHAVE, ssh_flags, start, write_hostfile

pytestmark = pytest.mark.cluster

SSH_TIMEOUT = "30"
PROMPT = 2.0  # seconds from the signal to the launcher's exit


@pytest.fixture
def node3_silent(sim_cluster: SimCluster) -> Iterator[None]:
    sshd = sim_cluster.host("node3").sshd_pid
    assert sshd is not None
    os.kill(sshd, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(sshd, signal.SIGCONT)


def _collect(stream: IO[str], into: list[str], marker: str | None,
             seen: threading.Event) -> None:
    for line in stream:
        into.append(line)
        if marker is not None and marker in line:
            seen.set()


def _interrupt(proc: subprocess.Popen[str], signals: list[signal.Signals],
               ready: tuple[str, str]) -> tuple[float, str]:
    """Signal ``proc`` once it printed the line that says it is connecting
    (``ready``: which stream, and a text in the line), not after a fixed time
    that a loaded machine may spend still importing."""
    assert proc.stdout is not None and proc.stderr is not None
    out: list[str] = []
    err: list[str] = []
    seen = threading.Event()
    readers = [threading.Thread(target=_collect, daemon=True, args=(
        stream, into, ready[1] if name == ready[0] else None, seen))
        for name, stream, into in [("stdout", proc.stdout, out), ("stderr", proc.stderr, err)]]
    try:
        for reader in readers:
            reader.start()
        assert seen.wait(30), f"no {ready[1]!r} line in 30 s: {out} {err}"
        time.sleep(0.5)  # into the connect: node3 has ~29 s of --ssh_timeout left
        assert proc.poll() is None, (out, err)
        sent = time.monotonic()
        for sig in signals:
            proc.send_signal(sig)
            time.sleep(0.3)
        proc.wait(timeout=15)
        took = time.monotonic() - sent - 0.3 * (len(signals) - 1)
    finally:
        proc.kill()
        proc.wait()
    for reader in readers:
        reader.join(timeout=10)
    return took, "".join(err)


@pytest.mark.parametrize("signals", [[signal.SIGINT], [signal.SIGTERM],
                                     [signal.SIGINT, signal.SIGINT]],
                         ids=["sigint", "sigterm", "sigint-twice"])
def test_a_signal_while_a_host_has_not_answered_ends_dsrun_at_once(
        sim_cluster: SimCluster, node3_silent: None, tmp_path: Path,
        signals: list[signal.Signals]) -> None:
    hostfile = write_hostfile(sim_cluster, tmp_path / "hostfile", ["node2", "node3"], slots=1)
    proc = start(sim_cluster, "-H", hostfile, *ssh_flags(sim_cluster), "--ssh_timeout",
                 SSH_TIMEOUT, "--dist_backend", "none", BEHAVE, "--pid_dir", str(tmp_path))
    took, err = _interrupt(proc, signals, ("stderr", "dsrun: connected 0/2 hosts"))
    assert proc.returncode == 128 + signals[0], err
    assert took < PROMPT, f"dsrun took {took:.1f}s to exit after the signal"
    assert "Traceback" not in err and "Exception ignored" not in err, err
    assert not list(tmp_path.glob("*.pid")), "a rank started"


def test_ctrl_c_ends_doctor_at_once_while_a_host_has_not_answered(
        sim_cluster: SimCluster, node3_silent: None, tmp_path: Path) -> None:
    hostfile = write_hostfile(sim_cluster, tmp_path / "hostfile", ["node2", "node3"], slots=1)
    proc = start(sim_cluster, "doctor", "-H", hostfile, *ssh_flags(sim_cluster),
                 "--ssh_timeout", SSH_TIMEOUT)
    took, err = _interrupt(proc, [signal.SIGINT], ("stdout", "checking 2 host(s)"))
    assert proc.returncode == 130, err
    assert took < PROMPT, f"dsrun doctor took {took:.1f}s to exit after Ctrl-C"
    assert "interrupted (Ctrl-C) before every host answered" in err, err
    assert "Traceback" not in err and "Exception ignored" not in err, err
