"""SIGUSR1/2 in an agent that is a task of a Slurm step with
``ProctrackType=proctrack/pgid``: Slurm signals only the task's process
group (the agent's; every rank leads its own), so the agent's own copy is
forwarded as outside Slurm; it was never forwarded, and no rank got one
(agent_forward.ranks_get_step_signals)."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from dsrun.launcher import agent_forward
from dsrun.launcher.agent_forward import (
    MERGE,
    Forwarder,
    in_step_cgroup,
    proctrack_of,
    ranks_get_step_signals,
)

USR1 = int(signal.SIGUSR1)


def _conf(tmp_path: Path, kind: str) -> dict[str, str]:
    conf = tmp_path / "slurm.conf"
    conf.write_text(f"ClusterName=c\n#ProctrackType=proctrack/cgroup\nProctrackType={kind}\n")
    return {"SLURM_CONF": str(conf)}


@pytest.mark.parametrize("kind, reach", [("proctrack/pgid", False),
                                         ("proctrack/linuxproc", True),
                                         ("proctrack/cgroup", True)])
def test_the_step_s_tracking_decides(tmp_path: Path, kind: str, reach: bool):
    assert ranks_get_step_signals(_conf(tmp_path, kind)) is reach


def test_under_pgid_the_agents_own_copy_reaches_the_ranks(tmp_path, monkeypatch):
    monkeypatch.setattr(agent_forward, "in_slurm_step", lambda: True)
    monkeypatch.setenv("SLURM_CONF", _conf(tmp_path, "proctrack/pgid")["SLURM_CONF"])
    now, sent = [100.0], []
    fwd = Forwarder(sent.append, lambda: now[0])
    fwd.note(USR1, launcher=False)  # scancel -s USR1 JOB: the agent's group only
    now[0] += 2 * MERGE
    fwd.settle()
    assert sent == [USR1]


def test_parsing():
    assert proctrack_of("ProctrackType = proctrack/PGID # comment\n") == "proctrack/pgid"
    assert proctrack_of("# ProctrackType=proctrack/pgid\n") is None
    assert in_step_cgroup("0::/system.slice/slurmstepd.scope/job_5/step_0/user/task_0\n")
    assert in_step_cgroup("4:freezer:/slurm/uid_0/job_5/step_0/task_1\n")
    assert not in_step_cgroup("0::/user.slice/user-0.slice/session-1.scope\n")
