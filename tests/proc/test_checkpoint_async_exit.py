"""Asynchronous saves of 2 ranks that fail at process exit or in the
commit, with real processes: the launcher stops every rank once one exits
non-zero, so a rank must not exit before rank 0 has cleared ``TAG.tmp/``,
nor before the other ranks have printed the error (once each); every rank
reports the same error; a commit failure reaches the other rank at once
(not after ``checkpoint.timeout``); a rank rank 0 gave up on does not
write ``TAG.tmp/`` again; the store's keys do not pile up save after save."""

from __future__ import annotations

import json
import re
import subprocess
import time
from pathlib import Path

import pytest

from tests.conftest import ROOT, dsrun_argv
from tests.proc.test_checkpoint_crash import clean_env, wait_for

pytestmark = pytest.mark.proc

WORKER = ROOT / "tests" / "proc" / "workers" / "async_exit_job.py"


def start(tmp_path: Path, mode: str, *args: str, **env: str) -> subprocess.Popen:
    argv = dsrun_argv("--cpu", "--num_gpus", "2", str(WORKER), "--mode", mode,
                      "--out", str(tmp_path), "--ckpt", str(tmp_path / "ckpt"), *args)
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=clean_env(**env), cwd=str(ROOT))


def error_lines(output: str, rank: int) -> list[str]:
    """The ``dsrun: error:`` lines rank ``rank`` printed (launcher prefix off)."""
    return [m.group(1) for m in re.finditer(rf"^\[[^\]]*:{rank}\] dsrun: error: (.*)$", output,
                                            re.MULTILINE)]


def lines_naming(output: str, rank: int, text: str) -> list[str]:
    """Every line of rank ``rank`` that contains ``text``."""
    return [line for line in output.splitlines()
            if re.match(rf"^\[[^\]]*:{rank}\] ", line) and text in line]


def assert_every_rank_printed_it_once(output: str, text: str) -> None:
    for rank in (0, 1):
        lines = lines_naming(output, rank, text)
        assert len(lines) == 1 and " dsrun: error: " in lines[0], (rank, output[-3000:])


def test_a_write_failing_at_exit_on_rank_1_waits_for_rank_0_to_clear_tag_tmp(
        tmp_path: Path) -> None:
    """Rank 1's write fails after its script ended while rank 0 is still
    writing (held at the pause point for a second): rank 1 must not exit -
    which makes the launcher stop rank 0 - before rank 0 has stopped,
    removed b.tmp/ and printed the error."""
    mark, release = tmp_path / "paused", tmp_path / "release"
    proc = start(tmp_path, "write-fails-at-exit", DSRUN_CHECKPOINT_TEST_PAUSE="0:write:b",
                 DSRUN_CHECKPOINT_TEST_PAUSE_MARK=str(mark),
                 DSRUN_CHECKPOINT_TEST_RELEASE=str(release))
    wait_for(mark, proc)
    time.sleep(1.5)  # time for rank 1 to fail and end
    release.touch()
    out, err = proc.communicate(timeout=120)
    output = out + err
    assert proc.returncode == 1, output[-3000:]
    assert not (tmp_path / "ckpt" / "b.tmp").exists(), output[-3000:]
    assert not (tmp_path / "ckpt" / "b").exists()
    lines = [error_lines(output, rank) for rank in (0, 1)]
    assert lines[0] and lines[0] == lines[1], output[-3000:]
    assert "rank_00001.bin" in lines[0][0] and "failed on rank 1" in lines[0][0]
    assert "file-size limit" in lines[0][0]
    assert_every_rank_printed_it_once(output, "rank_00001.bin")


def test_a_commit_failing_at_exit_fails_every_rank_with_rank_0s_error(tmp_path: Path) -> None:
    """Rank 0's rename fails after both scripts ended; rank 1's own part
    succeeded: it still exits with rank 0's error, not with status 0."""
    proc = start(tmp_path, "commit-fails-at-exit")
    out, err = proc.communicate(timeout=120)
    output = out + err
    assert proc.returncode == 1, output[-3000:]
    lines = [error_lines(output, rank) for rank in (0, 1)]
    assert lines[0] and lines[0] == lines[1], output[-3000:]
    assert "injected rename failure" in lines[0][0]
    assert not (tmp_path / "ckpt" / "b.tmp").exists()


def test_a_commit_failing_because_the_directory_vanished_fails_at_once(tmp_path: Path) -> None:
    """The save directory is removed just before rank 0's rename: every
    record existed before the commit, so no rank waits checkpoint.timeout
    (10 s) for records that went with the directory."""
    proc = start(tmp_path, "save-dir-vanishes")
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, (out + err)[-3000:]
    facts = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert facts[0]["error"] and facts[0]["error"] == facts[1]["error"], facts
    assert "committing: " in facts[0]["error"], facts
    assert all(f["seconds"] < 5 for f in facts), facts


@pytest.mark.parametrize("slow", [0, 1])
def test_a_save_failing_while_the_scripts_still_run_is_printed_by_every_rank(
        tmp_path: Path, slow: int) -> None:
    """The save fails at once; both scripts go on a while, rank ``slow``
    1.5 s longer: the rank that exits first waits for the other to end its
    script and print the error too, instead of having the launcher stop it."""
    proc = start(tmp_path, "write-fails-early", "--slow", str(slow))
    out, err = proc.communicate(timeout=120)
    output = out + err
    assert proc.returncode == 1, output[-3000:]
    for rank in (0, 1):
        assert lines_naming(output, rank, f"rank {rank}: script done"), output[-3000:]
    assert_every_rank_printed_it_once(output, "rank_00001.bin")
    assert not (tmp_path / "ckpt" / "b.tmp").exists(), output[-3000:]


def test_a_rank_given_up_on_does_not_write_tag_tmp_again(tmp_path: Path) -> None:
    """Rank 1 stays paused before it writes until rank 0 has given up on it
    (checkpoint.timeout 3 s) and removed b.tmp/: released, rank 1 must not
    make b.tmp/ again, and both ranks print rank 0's error."""
    mark, release = tmp_path / "paused", tmp_path / "release"
    tmp = tmp_path / "ckpt" / "b.tmp"
    proc = start(tmp_path, "straggler", "--timeout", "3", DSRUN_CHECKPOINT_TEST_PAUSE="1:stage:b",
                 DSRUN_CHECKPOINT_TEST_PAUSE_MARK=str(mark),
                 DSRUN_CHECKPOINT_TEST_RELEASE=str(release))
    wait_for(mark, proc)
    end = time.monotonic() + 60
    while not tmp.exists() and time.monotonic() < end:  # rank 0 writes its part
        time.sleep(0.02)
    while tmp.exists() and time.monotonic() < end:  # ... then gives rank 1 up
        time.sleep(0.02)
    release.touch()
    out, err = proc.communicate(timeout=120)
    output = out + err
    assert proc.returncode == 1, output[-3000:]
    assert not tmp.exists(), (sorted(p.name for p in tmp.iterdir()), output[-3000:])
    assert_every_rank_printed_it_once(output, "wrote nothing for 3 s")


def test_the_store_keys_of_async_saves_do_not_pile_up(tmp_path: Path) -> None:
    """Six saves, every other one failing on rank 1: the number of keys in
    the job's store is the same after every save that succeeded (only the
    last save's keys are kept), and after every one that failed but for
    rank 0's own failure key (posted when its writer saw rank 1's failure
    in time to stop)."""
    proc = start(tmp_path, "many-saves")
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, (out + err)[-3000:]
    keys = json.loads((tmp_path / "keys.json").read_text())
    assert keys[0] == keys[2] == keys[4], keys
    assert max(keys[1::2]) - min(keys[1::2]) <= 1 and min(keys[1::2]) > keys[0], keys
