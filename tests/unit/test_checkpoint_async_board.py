"""The store side of asynchronous saves, in this process with a HashStore
standing for rank 0's TCPStore: how often a rank asks the store while it
waits, the one deadline of the exit wait, what the exit prints, the keys a
save leaves, a writer that another rank's failure stops before it makes
``TAG.tmp/``; and the messages of a file-size limit and of a failure that is
not dsrun's bug."""

from __future__ import annotations

import errno
import logging
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

from dsrun.runtime.checkpoint import async_save, storage
from dsrun.runtime.checkpoint.coord import Failure, SaveBoard
from dsrun.runtime.checkpoint.rank_plan import RankPlan
from dsrun.runtime.checkpoint.writer import RankFailed, RankWrite, describe_failure


class Counting:
    """A HashStore that counts the calls made to it."""

    def __init__(self) -> None:
        self.store = dist.HashStore()
        self.calls = 0

    def __getattr__(self, name: str) -> Any:
        method = getattr(self.store, name)

        def counted(*args: Any) -> Any:
            self.calls += 1
            return method(*args)

        return counted


def test_a_thread_waiting_for_a_key_asks_the_store_less_and_less_often() -> None:
    store = Counting()
    board = SaveBoard(store, "p/", 2)
    threading.Timer(2.0, lambda: store.store.set("p/outcome", '{"error": null}')).start()
    found, value = board.wait_key("outcome", 10.0)
    assert found and value == {"error": None}
    assert store.calls <= 10, store.calls  # 40 at one check every 50 ms


class Exited(Exception):
    pass


def exiting_saver(monkeypatch: pytest.MonkeyPatch, world: int, rank: int,
                  timeout_s: float, store: Any) -> async_save.AsyncSaver:
    """A saver holding an error nobody collected, as the exit handler finds
    it; ``os._exit`` raises :class:`Exited` instead."""
    def fake_exit(status: int) -> None:
        raise Exited(status)

    monkeypatch.setattr(async_save.os, "_exit", fake_exit)
    monkeypatch.setattr(logging, "shutdown", lambda: None)
    saver = async_save.AsyncSaver(timeout_s)
    saver._error, saver._rank = "boom: the disk is full", rank
    saver._board = SaveBoard(store, "p/", world)
    monkeypatch.setattr(async_save, "_PENDING", {saver})
    return saver


def test_the_exit_wait_has_one_deadline_and_prints_the_error_once(
        monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str],
        caplog: pytest.LogCaptureFixture) -> None:
    """No other rank of 4 ever reports: the rank waits checkpoint.timeout
    once in all (not once per rank), in a few store calls, and prints the
    error once - one ``dsrun: error:`` line, no log record besides."""
    store = Counting()
    exiting_saver(monkeypatch, world=8, rank=1, timeout_s=1.0, store=store)
    caplog.set_level(logging.INFO, logger="dsrun")
    start = time.monotonic()
    with pytest.raises(Exited, match="1"):
        async_save._wait_at_exit()
    assert time.monotonic() - start < 5  # once per other rank would be 7 s
    assert store.calls <= 4, store.calls
    assert capfd.readouterr().err.count("boom: the disk is full") == 1
    assert [r for r in caplog.records if "boom" in r.getMessage()] == []


def test_the_exit_wait_ends_once_every_rank_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    """The other two ranks of 3 reported already (printed at exit, or raised
    in their script): nothing to wait for."""
    store = Counting()
    exiting_saver(monkeypatch, world=3, rank=0, timeout_s=30.0, store=store)
    for _ in (1, 2):
        SaveBoard(store, "p/", 3).report()
    start = time.monotonic()
    with pytest.raises(Exited):
        async_save._wait_at_exit()
    assert time.monotonic() - start < 5  # not the 30 s timeout
    assert store.store.check(["p/reported/all"])


def test_clear_deletes_every_key_of_the_save() -> None:
    store = dist.HashStore()
    board = SaveBoard(store, "p/", 3)
    board.post(Failure(2, "no space"))
    board.post_key("outcome", {"error": "no space"})
    for _ in range(3):
        board.report()
    assert store.num_keys() > 0
    board.clear()
    assert store.num_keys() == 0


def test_a_writer_stopped_by_another_ranks_failure_does_not_make_tag_tmp(
        tmp_path: Path) -> None:
    """Rank 0 gave this rank up (posted its failure, removed TAG.tmp/):
    this rank, arriving late, stops before it makes the directory again."""
    board = SaveBoard(dist.HashStore(), "p/", 2)
    board.post(Failure(0, "committing: rank(s) 1 wrote nothing for 3 s"))
    write = RankWrite(str(tmp_path / "b.tmp"), 1, RankPlan(), {}, board=board)
    with pytest.raises(RankFailed, match="wrote nothing"):
        write.run()
    assert not (tmp_path / "b.tmp").exists()


@pytest.mark.parametrize("limit, blamed", [(None, False), (1 << 40, False), (4096, True)])
def test_a_file_size_error_blames_ulimit_only_when_the_write_reached_it(
        monkeypatch: pytest.MonkeyPatch, limit: Any, blamed: bool) -> None:
    """EFBIG 4096 bytes into a file: the process's RLIMIT_FSIZE is named only
    when it is 4096 (the write reached it); a larger limit (or none) means
    the file system refused the size."""
    monkeypatch.setattr(storage, "_file_size_limit", lambda: limit)
    text = str(storage.disk_full_error("/ck/b.tmp/rank_00001.bin",
                                       OSError(errno.EFBIG, "File too large"), 4096, 10000))
    assert "file-size limit was reached writing /ck/b.tmp/rank_00001.bin" in text, text
    assert ("ulimit -f" in text) == blamed, text
    assert ("the file system refused a file that large" in text) == (not blamed), text
    assert "freeing space will not help" in text, text


@pytest.mark.parametrize("exc, loud", [(MemoryError("cannot allocate"), False),
                                       (OSError(errno.EIO, "I/O error"), False),
                                       (TypeError("a bug"), True)])
def test_only_a_possible_bug_logs_its_traceback(caplog: pytest.LogCaptureFixture,
                                                exc: Exception, loud: bool) -> None:
    caplog.set_level(logging.INFO, logger="dsrun")
    try:
        raise exc
    except Exception as raised:  # noqa: BLE001 - a traceback to describe
        text = describe_failure(raised)
    assert text == f"{type(exc).__name__}: {exc}"
    assert any(r.exc_info for r in caplog.records if r.levelno >= logging.INFO) == loud
