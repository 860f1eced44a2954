"""A rank that exits after rank 0 (whose process held the job's store) says
nothing more than the script does: its exit mark (runtime/exitmark.py) is
not posted to a store that is gone, so torch prints no C++ stack trace
("sendBytes failed ... Broken pipe", "frame #N") into the job's output."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import run_dsrun
from tests.proc.test_checkpoint_crash import clean_env

pytestmark = pytest.mark.proc

SCRIPT = """\
import time, torch, torch.distributed as dist, dsrun
dsrun.init_distributed(dist_backend="gloo")
t = torch.ones(1)
dist.all_reduce(t)
if dist.get_rank() == 1:
    time.sleep(1.0)  # outlives rank 0 and its store
print("rank", dist.get_rank(), "done", flush=True)
"""
NOISE = ("sendBytes", "recvBytes", "Broken pipe", "frame #", "[c10d]", "Exception raised")


def test_a_rank_that_outlives_rank_0_exits_quietly(tmp_path: Path) -> None:
    script = tmp_path / "late_rank_1.py"
    script.write_text(SCRIPT)
    res = run_dsrun("--cpu", "--num_gpus", "2", str(script), timeout=60, env=clean_env())
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-3000:]
    assert "rank 1 done" in out, out[-3000:]
    noise = [line for line in out.splitlines() if any(n in line for n in NOISE)]
    assert not noise, "\n".join(noise[:5])
