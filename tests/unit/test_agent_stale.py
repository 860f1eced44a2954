"""agent_stale.claim: an agent removes the directories of gone agents of any
dsrun job of this user (same boot and pid namespace), never a live agent's,
one without an owner file, or a link; and nothing where /proc is another
pid namespace's."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from dsrun.launcher import agent_stale
from dsrun.launcher.procs import Proc

JOB = "abcdef12" + "0" * 24


def _owned(base: Path, name: str, owner: str, job: str = JOB) -> Path:
    path = base / name
    path.mkdir(mode=0o700)
    (path / "stack_1.txt").write_text("")
    boot, ns = agent_stale._machine() or ("?", "?")
    (path / agent_stale.OWNER).write_text(f"{job}\n{boot}\n{ns}\n{owner}\n")
    return path


def _dead() -> str:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(5)"])
    proc = Proc.of(child.pid)
    child.kill()
    child.wait()
    assert proc is not None
    return proc.line()


def test_only_the_directories_of_gone_agents_are_removed(tmp_path: Path):
    live = Proc.of(os.getppid())
    assert live is not None
    dead = _owned(tmp_path, "dsrun-abcdef12-dead", _dead())
    reused = _owned(tmp_path, "dsrun-abcdef12-reused", f"{live.pid} {live.started + 1!r}")
    alive = _owned(tmp_path, "dsrun-abcdef12-alive", live.line())
    # an interrupted job is not restarted: a later job's agent removes its dirs
    other_job = _owned(tmp_path, "dsrun-99999999-other", _dead(), job="9" * 32)
    no_owner = tmp_path / "dsrun-abcdef12-new"
    no_owner.mkdir()
    (tmp_path / "dsrun-abcdef12-link").symlink_to(dead)
    mine = tmp_path / "dsrun-abcdef12-mine"
    mine.mkdir()
    removed = agent_stale.claim(str(mine), JOB)
    assert sorted(removed) == sorted([str(dead), str(reused), str(other_job)])
    assert not dead.exists() and not reused.exists() and not other_job.exists()
    assert alive.exists() and no_owner.exists()
    assert (tmp_path / "dsrun-abcdef12-link").is_symlink()
    assert (mine / agent_stale.OWNER).read_text().startswith(JOB + "\n")


def test_another_machine_s_directory_is_left_alone(tmp_path: Path):
    gone = tmp_path / "dsrun-abcdef12-x"
    gone.mkdir()
    (gone / agent_stale.OWNER).write_text(f"{JOB}\nother-boot\nns\n{_dead()}\n")
    mine = tmp_path / "dsrun-abcdef12-mine"
    mine.mkdir()
    assert agent_stale.claim(str(mine), JOB) == [] and gone.exists()


def test_nothing_is_claimed_where_proc_is_another_pid_namespace_s(tmp_path: Path, monkeypatch):
    """/proc/<our pid> would be another process there (unshare --pid without
    --mount-proc): its start time would be recorded as ours."""
    dead = _owned(tmp_path, "dsrun-abcdef12-dead", _dead())
    mine = tmp_path / "dsrun-abcdef12-mine"
    mine.mkdir()
    real = os.readlink
    monkeypatch.setattr(os, "readlink", lambda p, *a, **kw: str(os.getpid() + 100000)
                        if p == "/proc/self" else real(p, *a, **kw))
    assert agent_stale.claim(str(mine), JOB) == []
    assert dead.exists() and not (mine / agent_stale.OWNER).exists()
