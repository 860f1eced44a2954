"""What a host prints before (or instead of) starting the node agent - a
login shell's greeting without a newline, a forced command's refusal,
``nologin`` - reaches the user. The stand-in for a remote login is a
wrapper "interpreter" for the local backend that prints, then execs the
real Python (or never does)."""

from __future__ import annotations

import os
import queue
import sys
import uuid
from pathlib import Path

from dsrun.launcher.backends.local import LocalBackend
from dsrun.launcher.cluster import ProbeOutcome, here_facts, probe_cluster, resolve_cluster
from dsrun.launcher.envpolicy import JobEnv
from dsrun.launcher.plan import build_plan
from dsrun.launcher.spec import HostsSpec, LaunchSpec, SshOptions

NOLOGIN = "This account is currently not available."
UBUNTU = 'Please login as the user "ubuntu" rather than the user "root".'


def _wrapper(tmp_path: Path, body: str) -> str:
    path = tmp_path / "login-python"
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(0o755)
    return str(path)


def _probe(tmp_path: Path, python: str, timeout: float = 20.0
           ) -> tuple[ProbeOutcome, list[dict[str, object]]]:
    """Probe this host through an agent started by ``python``; the outcome
    and the events left for the job (the host's lines among them)."""
    hs = HostsSpec(hostfile=None, num_gpus=1, cpu=True, ssh=SshOptions(timeout=timeout))
    cluster, _ = resolve_cluster(hs, str(tmp_path))
    backend = LocalBackend(hs, python=python)
    plan = build_plan(LaunchSpec(script="job.py", num_gpus=1, cpu=True), cluster, JobEnv(),
                      uuid.uuid4().hex, facts=here_facts(cluster), python=backend.python,
                      cwd=os.getcwd())
    handle = backend.open(plan, lambda *a: None)
    try:
        outcome = probe_cluster(handle, cluster, backend, hs, versions=False)
    finally:
        handle.close()
    left = []
    while True:
        try:
            left.append(handle.events.get_nowait()[1])
        except queue.Empty:
            return outcome, left


def test_a_greeting_without_newline_neither_hides_the_agent_nor_is_lost(tmp_path: Path) -> None:
    python = _wrapper(tmp_path, f"printf 'Welcome to the cluster'\nexec {sys.executable} \"$@\"")
    outcome, left = _probe(tmp_path, python)
    assert not outcome.failed(), outcome.lines()
    assert outcome.seconds < 10
    assert {"ev": "garbage", "line": "Welcome to the cluster"} in \
        [{k: v for k, v in e.items() if k != "_recv"} for e in left]


def test_nologin_text_on_stdout_is_the_reason(tmp_path: Path) -> None:
    outcome, _ = _probe(tmp_path, _wrapper(tmp_path, f"echo '{NOLOGIN}'\nexit 1"))
    [report] = outcome.failed()
    assert report.errors == (f"node agent on {report.host} exited unexpectedly (status 1): "
                             f"{NOLOGIN}",)


def test_a_forced_command_that_never_answers_is_quoted(tmp_path: Path) -> None:
    # Ubuntu cloud images' root key: a message, a blank line, a wait, an exit.
    body = f"echo '{UBUNTU}'; echo; cat >/dev/null; exit 142"
    outcome, _ = _probe(tmp_path, _wrapper(tmp_path, body), timeout=1.0)
    [report] = outcome.failed()
    assert report.errors == (f"the node agent on {report.host} did not answer within 1s "
                             f"(--ssh_timeout) (it printed: {UBUNTU})",)
