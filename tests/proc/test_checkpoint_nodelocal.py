"""Checkpoint directories that are not one directory shared by every rank
(node-local storage, simulated by giving each rank its own path): a save
fails at its start on every rank, after a wait for a late file that is
short next to checkpoint.timeout (sync and async), naming the ranks and
hosts and saying the directory is not shared, and leaves no ``TAG.tmp/``;
a load of two different checkpoints under one tag, or of different
``latest`` files, is refused with the engine unchanged."""

from __future__ import annotations

import json
import re
import socket
from pathlib import Path

import pytest

from tests.conftest import ROOT, run_dsrun
from tests.proc.test_checkpoint_crash import clean_env

pytestmark = pytest.mark.proc

WORKER = ROOT / "tests" / "proc" / "workers" / "nodelocal_job.py"
TIMEOUT = 20.0  # checkpoint.timeout: the old async save waited all of it
# how long rank 1 looks for rank 0's TAG.tmp/ (a network file system shows
# another host's new file late): a quarter of checkpoint.timeout, at most 30 s
MARK_WAIT = 5.0
HOST = socket.gethostname()


def run(tmp_path: Path, mode: str) -> list[dict]:
    res = run_dsrun("--cpu", "--num_gpus", "2", str(WORKER), "--mode", mode,
                    "--timeout", str(TIMEOUT), "--out", str(tmp_path),
                    timeout=120, env=clean_env())
    assert res.returncode == 0, res.stderr[-4000:]
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]


def check_save(ranks: list[dict], tmp_path: Path) -> None:
    for rank in ranks:
        save = rank["save"]
        assert save["error"] is not None and MARK_WAIT <= save["seconds"] < MARK_WAIT + 5, save
        assert "is not shared between hosts, or its file system shows other hosts' files " \
            "late" in save["error"], save
        assert f"rank 1 (host {HOST}) cannot see the u.tmp/ that rank 0 (host {HOST}) " \
            "created there, within 5 s" in save["error"], save
        assert "use_node_local_storage is not supported" in save["error"]
        # one error on every rank (each names its own path: one path on real hosts)
        assert re.sub("host[01]", "", save["error"]) == re.sub("host[01]", "",
                                                               ranks[0]["save"]["error"])
        assert rank["left"] == [], rank  # no TAG.tmp/ in either rank's directory
        assert rank["after"]["error"] is None, rank["after"]
    assert not (tmp_path / "host0" / "ck" / "latest").exists()


def test_a_sync_save_and_loads_across_private_directories(tmp_path):
    ranks = run(tmp_path, "sync")
    for rank in ranks:
        mixed = rank["mixed"]
        assert mixed["error"] and mixed["unchanged"], mixed
        assert "the ranks read different checkpoints under tag 't'" in mixed["error"], mixed
        assert f"rank 0 (host {HOST}): {tmp_path / 'ckA' / 't'} (saved by 2 ranks, at global " \
            "step 1" in mixed["error"], mixed
        assert f"rank 1 (host {HOST}): {tmp_path / 'ckB' / 't'}" in mixed["error"], mixed
        latest = rank["latest"]
        assert latest["error"] and latest["unchanged"], latest
        assert "the ranks read different 'latest' files (rank 0 (host " in latest["error"]
        # each rank names its own path (one path on real hosts)
        assert f"reads 't' from {tmp_path}/" in latest["error"], latest
        assert f"/latest; rank 1 (host {HOST}) finds no {tmp_path}/" in latest["error"], latest
        assert "every rank must pass the same value" not in latest["error"]
        tag = rank["tag"]
        assert tag["error"] and tag["unchanged"], tag
        assert "does not exist (rank 0 (host " in tag["error"], tag
        assert "found it: is" in tag["error"] and "every rank shares?" in tag["error"], tag
    check_save(ranks, tmp_path)


def test_an_async_save_into_private_directories_fails_at_once(tmp_path):
    check_save(run(tmp_path, "async"), tmp_path)
