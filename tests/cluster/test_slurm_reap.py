"""The test Slurm's reaper ends the daemons of a run whose owner died, and only those.

No Slurm is needed: stand-in processes play the recorded daemons.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
from slurmhosts import reap_dead_runs

pytestmark = pytest.mark.cluster


def _sleeper() -> subprocess.Popen[bytes]:
    return subprocess.Popen(["sleep", "60"], start_new_session=True)


def _record(run_dir: Path, owner: psutil.Process | tuple[int, float],
            daemons: list[subprocess.Popen[bytes]]) -> None:
    run_dir.mkdir()
    pid, ctime = (owner.pid, owner.create_time()) if isinstance(owner, psutil.Process) \
        else owner
    run_dir.joinpath("run.json").write_text(json.dumps({
        "owner_pid": pid, "owner_ctime": ctime,
        "daemons": [{"pid": d.pid, "ctime": psutil.Process(d.pid).create_time()}
                    for d in daemons]}))


def test_daemons_of_a_dead_owner_are_ended_and_live_runs_kept(tmp_path: Path) -> None:
    dead_owner = subprocess.Popen([sys.executable, "-c", "pass"])
    owner_ctime = psutil.Process(dead_owner.pid).create_time()
    dead_owner.wait()
    orphans = [_sleeper(), _sleeper()]
    kept = _sleeper()
    stranger = _sleeper()  # not recorded with its start time: must survive
    try:
        _record(tmp_path / "dsrun-slurm-dead", (dead_owner.pid, owner_ctime), orphans)
        _record(tmp_path / "dsrun-slurm-live", psutil.Process(), [kept])
        stale = tmp_path / "dsrun-slurm-recycled"
        stale.mkdir()
        stale.joinpath("run.json").write_text(json.dumps({
            "owner_pid": dead_owner.pid, "owner_ctime": owner_ctime,
            "daemons": [{"pid": stranger.pid, "ctime": 1.0}]}))
        (tmp_path / "dsrun-slurm-torn").mkdir()
        (tmp_path / "dsrun-slurm-torn" / "run.json").write_text("{not json")

        reaped = reap_dead_runs(str(tmp_path))

        assert sorted(Path(p).name for p in reaped) == ["dsrun-slurm-dead",
                                                         "dsrun-slurm-recycled"]
        for proc in orphans:
            assert proc.wait(timeout=10) is not None
        assert not (tmp_path / "dsrun-slurm-dead").exists()
        assert kept.poll() is None and stranger.poll() is None
        assert (tmp_path / "dsrun-slurm-live" / "run.json").exists()
        assert (tmp_path / "dsrun-slurm-torn").exists()
    finally:
        for proc in [*orphans, kept, stranger]:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
