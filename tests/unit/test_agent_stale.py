"""agent_stale.claim: an agent removes only its own job's directories whose
agent is gone (same boot and pid namespace), never a live agent's, another
job's, one without an owner file, or a link."""

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


def test_only_the_jobs_directories_of_gone_agents_are_removed(tmp_path: Path):
    live = Proc.of(os.getppid())
    assert live is not None
    dead = _owned(tmp_path, "dsrun-abcdef12-dead", _dead())
    reused = _owned(tmp_path, "dsrun-abcdef12-reused", f"{live.pid} {live.started + 1!r}")
    alive = _owned(tmp_path, "dsrun-abcdef12-alive", live.line())
    other_job = _owned(tmp_path, "dsrun-abcdef12-other", _dead(), job="abcdef12" + "1" * 24)
    no_owner = tmp_path / "dsrun-abcdef12-new"
    no_owner.mkdir()
    (tmp_path / "dsrun-abcdef12-link").symlink_to(dead)
    mine = tmp_path / "dsrun-abcdef12-mine"
    mine.mkdir()
    removed = agent_stale.claim(str(mine), JOB)
    assert sorted(removed) == sorted([str(dead), str(reused)])
    assert not dead.exists() and not reused.exists()
    assert alive.exists() and other_job.exists() and no_owner.exists()
    assert (tmp_path / "dsrun-abcdef12-link").is_symlink()
    assert (mine / agent_stale.OWNER).read_text().startswith(JOB + "\n")


def test_another_machine_s_directory_is_left_alone(tmp_path: Path):
    gone = tmp_path / "dsrun-abcdef12-x"
    gone.mkdir()
    (gone / agent_stale.OWNER).write_text(f"{JOB}\nother-boot\nns\n{_dead()}\n")
    mine = tmp_path / "dsrun-abcdef12-mine"
    mine.mkdir()
    assert agent_stale.claim(str(mine), JOB) == [] and gone.exists()
