"""Real processes (gloo ranks): a rank that leaves through ``os._exit``
posts no exit mark of its own (runtime/exitmark.py), so its node agent
posts it (launcher/agent_marks.py) and the peer's checkpoint agreement
names it within a second or two. The old code left the peer waiting the
whole ``checkpoint.timeout`` (60 s here).
"""

from __future__ import annotations

import json

import pytest

from tests.conftest import ROOT, run_dsrun
from tests.proc.test_checkpoint_crash import clean_env

pytestmark = pytest.mark.proc

WORKER = ROOT / "tests" / "proc" / "workers" / "os_exit_job.py"


def test_a_rank_gone_through_os_exit_before_the_save_is_named_at_once(tmp_path):
    res = run_dsrun("--cpu", "--num_gpus", "2", str(WORKER), "--exiter", "1",
                    "--timeout", "60", "--out", str(tmp_path), timeout=120, env=clean_env())
    assert res.returncode == 1, res.stderr[-3000:]
    saver = json.loads((tmp_path / "saver.json").read_text())
    assert saver["rank"] == 0 and saver["seconds"] < 5, saver  # about 1.5 s here
    assert ("engine.save_checkpoint() failed on rank 0: rank 1 exited (status 0) before "
            "calling engine.save_checkpoint()" in saver["error"]), saver
    ckpt = tmp_path / "ckpt"
    assert (ckpt / "latest").read_text().strip() == "t1"
    assert not [p.name for p in ckpt.iterdir() if p.name.startswith("t2")]
