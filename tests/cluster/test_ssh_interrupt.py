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
import time
from collections.abc import Iterator
from pathlib import Path

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


def _interrupt(proc: subprocess.Popen[str], signals: list[signal.Signals]
               ) -> tuple[float, str]:
    time.sleep(2.5)  # node2 answered; node3 has ~27s of --ssh_timeout left
    assert proc.poll() is None, proc.communicate()
    sent = time.monotonic()
    for sig in signals:
        proc.send_signal(sig)
        time.sleep(0.3)
    try:
        _, err = proc.communicate(timeout=15)
    finally:
        proc.kill()
    return time.monotonic() - sent - 0.3 * (len(signals) - 1), err


@pytest.mark.parametrize("signals", [[signal.SIGINT], [signal.SIGTERM],
                                     [signal.SIGINT, signal.SIGINT]],
                         ids=["sigint", "sigterm", "sigint-twice"])
def test_a_signal_while_a_host_has_not_answered_ends_dsrun_at_once(
        sim_cluster: SimCluster, node3_silent: None, tmp_path: Path,
        signals: list[signal.Signals]) -> None:
    hostfile = write_hostfile(sim_cluster, tmp_path / "hostfile", ["node2", "node3"], slots=1)
    proc = start(sim_cluster, "-H", hostfile, *ssh_flags(sim_cluster), "--ssh_timeout",
                 SSH_TIMEOUT, "--dist_backend", "none", BEHAVE, "--pid_dir", str(tmp_path))
    took, err = _interrupt(proc, signals)
    assert proc.returncode == 128 + signals[0], err
    assert took < PROMPT, f"dsrun took {took:.1f}s to exit after the signal"
    assert "Traceback" not in err and "Exception ignored" not in err, err
    assert not list(tmp_path.glob("*.pid")), "a rank started"


def test_ctrl_c_ends_doctor_at_once_while_a_host_has_not_answered(
        sim_cluster: SimCluster, node3_silent: None, tmp_path: Path) -> None:
    hostfile = write_hostfile(sim_cluster, tmp_path / "hostfile", ["node2", "node3"], slots=1)
    proc = start(sim_cluster, "doctor", "-H", hostfile, *ssh_flags(sim_cluster),
                 "--ssh_timeout", SSH_TIMEOUT)
    took, err = _interrupt(proc, [signal.SIGINT])
    assert proc.returncode == 130, err
    assert took < PROMPT, f"dsrun doctor took {took:.1f}s to exit after Ctrl-C"
    assert "interrupted (Ctrl-C) before every host answered" in err, err
    assert "Traceback" not in err and "Exception ignored" not in err, err
