"""What a failing save prints at world size 1, in this process: one line
per failure and the error itself - no traceback of dsrun's own code for a
file system's answer (an ``OSError``), and no message about telling "rank 0"
when this rank is rank 0; and the disk-full messages after the commit's
rename (``latest``), which say the new tag is complete."""

from __future__ import annotations

import errno
import logging
import os
from pathlib import Path
from typing import Any

import pytest

from dsrun.errors import CheckpointError
from dsrun.runtime.checkpoint import storage
from tests.dist.test_checkpoint_world1 import engine_for, train

pytestmark = pytest.mark.dist


def fail_writes_to(name: str, err: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Writes to files whose name starts with ``name`` fail with ``err``."""
    real = storage.write_all

    def write_all(fd: int, data: memoryview) -> None:
        if os.path.basename(os.readlink(f"/proc/self/fd/{fd}")).startswith(name):
            raise storage.WriteFailed(OSError(err, os.strerror(err)), 0)
        real(fd, data)

    monkeypatch.setattr(storage, "write_all", write_all)


def loud_records(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    """Records that print a traceback, or talk of telling rank 0."""
    return [r for r in caplog.records if r.levelno >= logging.INFO
            and (r.exc_info or "tell rank 0" in r.getMessage())]


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_a_full_disk_at_latest_says_the_new_tag_is_complete(
        solo: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture, mode: str) -> None:
    engine = engine_for(stage=2, checkpoint={"async": mode == "async"})
    train(engine)
    engine.save_checkpoint(tmp_path, tag="a")
    engine.wait_for_checkpoint()
    fail_writes_to("latest", errno.ENOSPC, monkeypatch)
    caplog.set_level(logging.INFO, logger="dsrun")
    with pytest.raises(CheckpointError) as info:
        engine.save_checkpoint(tmp_path, tag="b")
        engine.wait_for_checkpoint()
    text = str(info.value)
    assert "checkpoint 'b' is complete in" in text, text
    assert "latest still names 'a'" in text, text
    assert "no space left on the device writing" in text and "latest.tmp" in text, text
    assert "this rank's" not in text and "previous checkpoint is intact" not in text, text
    assert loud_records(caplog) == []
    assert (tmp_path / "latest").read_text() == "a"
    monkeypatch.undo()
    fresh = engine_for(stage=2, seed=5)
    assert fresh.load_checkpoint(tmp_path, tag="b")[0] == str(tmp_path / "b")
    engine.destroy()


def test_a_full_disk_at_the_manifest_does_not_call_it_this_ranks_data(
        solo: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    engine = engine_for(stage=1)
    train(engine)
    fail_writes_to("manifest.json", errno.ENOSPC, monkeypatch)
    with pytest.raises(CheckpointError, match="manifest.json.*previous checkpoint is intact") \
            as info:
        engine.save_checkpoint(tmp_path, tag="b")
    assert "this rank's" not in str(info.value)


def test_a_file_size_limit_is_not_called_a_full_disk(
        solo: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    engine = engine_for(stage=1)
    train(engine)
    fail_writes_to("rank_00000.bin", errno.EFBIG, monkeypatch)
    with pytest.raises(CheckpointError) as info:
        engine.save_checkpoint(tmp_path, tag="b")
    text = str(info.value)
    assert "no space left" not in text and "free space or" not in text, text
    assert "file-size limit was reached writing" in text and "rank_00000.bin" in text, text
    assert "freeing space will not help" in text, text
    assert "previous checkpoint is intact" in text, text


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_a_save_directory_that_cannot_be_made_fails_in_one_line(
        solo: None, tmp_path: Path, caplog: pytest.LogCaptureFixture, mode: str) -> None:
    """TAG.tmp cannot be made (a file is in the way; a read-only file system
    or a removed directory behave alike): the error, no traceback."""
    engine = engine_for(stage=2, checkpoint={"async": mode == "async"})
    train(engine)
    (tmp_path / "b.tmp").write_text("in the way")
    caplog.set_level(logging.INFO, logger="dsrun")
    with pytest.raises(CheckpointError, match=r"b\.tmp.*File exists.*previous checkpoint is "
                                              "intact"):
        engine.save_checkpoint(tmp_path, tag="b")
        engine.wait_for_checkpoint()
    assert loud_records(caplog) == []
    engine.destroy()


def test_an_async_commit_failure_at_one_rank_logs_no_traceback(
        solo: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    from dsrun.runtime.checkpoint import writer

    engine: Any = engine_for(stage=2, checkpoint={"async": True})
    train(engine)

    def broken(tmp: str, final: str) -> None:
        raise OSError(errno.EIO, "injected rename failure")

    monkeypatch.setattr(writer, "replace_dir", broken)
    caplog.set_level(logging.INFO, logger="dsrun")
    with pytest.raises(CheckpointError, match="committing: OSError.*injected rename failure"):
        engine.save_checkpoint(tmp_path, tag="b")
        engine.wait_for_checkpoint()
    assert loud_records(caplog) == []
    assert not (tmp_path / "b.tmp").exists() and not (tmp_path / "b").exists()
    engine.destroy()
