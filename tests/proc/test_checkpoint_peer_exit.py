"""A rank that exits (status 0) before or during ``save_checkpoint`` while
another rank saves: the saving rank fails within about a second (not after
``checkpoint.timeout``) with one error naming the rank that left and its
status; the previous checkpoint and ``latest`` stay, no part of the new
tag is left; the launcher's report names the exit as the likely cause.
Also when the rank that leaves is rank 0, which holds the job's store."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import ROOT, run_dsrun
from tests.proc.test_checkpoint_crash import clean_env

pytestmark = pytest.mark.proc

WORKER = ROOT / "tests" / "proc" / "workers" / "peer_exit_job.py"
TIMEOUT = 8.0  # checkpoint.timeout: the old code waited all of it


def run(tmp_path: Path, mode: str, exiter: int = 1, sleep: float = 0.0) -> tuple[dict, str]:
    res = run_dsrun("--cpu", "--num_gpus", "2", str(WORKER), "--mode", mode,
                    "--exiter", str(exiter), "--sleep", str(sleep),
                    "--timeout", str(TIMEOUT), "--out", str(tmp_path),
                    timeout=60, env=clean_env())
    assert res.returncode == 1, res.stderr[-3000:]
    saver = json.loads((tmp_path / "saver.json").read_text())
    ckpt = tmp_path / "ckpt"
    assert (ckpt / "latest").read_text().strip() == "t1"
    assert (ckpt / "t1").is_dir()
    assert not [p.name for p in ckpt.iterdir() if p.name.startswith("t2")], res.stderr[-3000:]
    return saver, res.stderr


def check_report(stderr: str, exiter: int) -> None:
    assert (f"job failed: rank {exiter} on host " in stderr
            and "exited with status 0 while other ranks were still running (the likely "
                "cause)" in stderr), stderr[-3000:]
    assert f"it was still waiting for rank {exiter} (its error says so)" in stderr


def test_a_rank_that_exits_before_the_save_is_named_at_once(tmp_path):
    saver, stderr = run(tmp_path, "before")
    assert saver["seconds"] < 4, saver
    assert ("engine.save_checkpoint() failed on rank 0: rank 1 exited (status 0) before "
            "calling engine.save_checkpoint()" in saver["error"]), saver
    assert "the previous checkpoint and 'latest' are intact" in saver["error"]
    check_report(stderr, 1)


def test_a_rank_that_exits_during_the_save_is_named_and_its_tag_removed(tmp_path):
    saver, stderr = run(tmp_path, "during")
    assert saver["seconds"] < 4, saver
    assert "rank 1 exited (status 0) during the save" in saver["error"], saver
    check_report(stderr, 1)


def test_rank_0_leaving_is_named_by_its_mark(tmp_path):
    saver, stderr = run(tmp_path, "before", exiter=0)
    assert saver["seconds"] < 4, saver
    assert "rank 0 exited (status 0) before calling engine.save_checkpoint()" \
        in saver["error"], saver
    check_report(stderr, 0)


def test_rank_0_gone_with_its_store_is_named(tmp_path):
    """The saving rank arrives when rank 0 and its store are gone."""
    saver, stderr = run(tmp_path, "before", exiter=0, sleep=1.5)
    assert saver["seconds"] < 4, saver
    assert ("engine.save_checkpoint() failed: rank 0 (which holds the job's store) exited "
            "or cannot be reached" in saver["error"]), saver
    assert "\n" not in saver["error"]  # no C++ frames of torch's store error
    # nor in the output: neither the saver's agreement nor rank 1's exit
    # mark calls the store once its port refuses connections
    noise = [line for line in stderr.splitlines()
             if "sendBytes" in line or "frame #" in line or "[c10d]" in line]
    assert not noise, "\n".join(noise[:5])
    assert "rank 0 on host" in stderr and "(the likely cause)" in stderr, stderr[-3000:]
