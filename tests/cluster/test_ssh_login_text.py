"""What a simulated host's login prints on stdout before (or instead of)
the node agent reaches the user: a greeting without a final newline does
not hide the agent's first message, and a refusal (``nologin``'s text) is
the reason given. The host's sshd runs a ``ForceCommand`` for this (its
config is restored, and sshd restarted, afterwards)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from simhosts import SimCluster
from sshjobs import run, ssh_flags, write_hostfile

pytestmark = pytest.mark.cluster

HOST = "node4"
NOLOGIN = "This account is currently not available."


@contextmanager
def forced_command(cluster: SimCluster, host: str, command: str) -> Iterator[None]:
    """``host``'s sshd runs ``command`` (sshd_config ForceCommand) for every
    session, with the client's command in $SSH_ORIGINAL_COMMAND."""
    assert cluster.workdir is not None
    config = cluster.workdir / f"sshd_config-{host}"
    original = config.read_text()
    config.write_text(f"{original}ForceCommand {command}\n")
    cluster.stop_sshd(host)
    try:
        cluster.start_sshd(host)
        yield
    finally:
        config.write_text(original)
        cluster.stop_sshd(host)
        cluster.start_sshd(host)


def test_a_greeting_without_newline_is_shown_and_the_job_runs(sim_cluster: SimCluster,
                                                              tmp_path: Path) -> None:
    hostfile = write_hostfile(sim_cluster, tmp_path / "hostfile", ["node1", HOST], slots=1)
    script = tmp_path / "hello.py"
    script.write_text("import os\nprint('rank', os.environ['RANK'], 'ran')\n")
    flags = ["-H", hostfile, *ssh_flags(sim_cluster), "--ssh_timeout", "5"]
    with forced_command(sim_cluster, HOST,
                        "printf 'Welcome to the cluster'; eval \"$SSH_ORIGINAL_COMMAND\""):
        doctor = run(sim_cluster, "doctor", *flags)
        job = run(sim_cluster, *flags, "--dist_backend", "none", str(script))
    assert doctor.returncode == 0, doctor.stdout + doctor.stderr
    assert "all 2 host(s) ok" in doctor.stdout
    assert job.returncode == 0, job.stdout + job.stderr
    out = job.stdout + job.stderr
    assert f"[{HOST}:agent] Welcome to the cluster" in out
    assert "rank 1 ran" in out


def test_nologin_text_is_the_reason(sim_cluster: SimCluster, tmp_path: Path) -> None:
    hostfile = write_hostfile(sim_cluster, tmp_path / "hostfile", ["node1", HOST], slots=1)
    with forced_command(sim_cluster, HOST, f"echo '{NOLOGIN}'; exit 1"):
        doctor = run(sim_cluster, "doctor", "-H", hostfile, *ssh_flags(sim_cluster),
                     "--ssh_timeout", "5")
    assert doctor.returncode == 1, doctor.stdout + doctor.stderr
    assert (f"{HOST}  FAIL  node agent on {HOST} exited unexpectedly (status 1): {NOLOGIN}"
            in doctor.stdout), doctor.stdout
