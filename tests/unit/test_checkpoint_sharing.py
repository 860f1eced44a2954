"""The checks that a checkpoint directory is one directory every rank
shares (dsrun/runtime/checkpoint/sharing.py), the pieces that need no
second process; tests/proc/test_checkpoint_nodelocal.py runs them on two
ranks."""

from __future__ import annotations

import logging
import os
import re
import threading
import time
from typing import Any, Optional

import pytest
import torch

from dsrun.errors import CheckpointError
from dsrun.runtime.checkpoint import sharing
from dsrun.runtime.checkpoint.fragments import ExportedState, Fragment, TensorInfo
from dsrun.runtime.checkpoint.manifest import SAVE_ID
from dsrun.runtime.checkpoint.tags import remove_stale_saves
from dsrun.runtime.checkpoint.writer import SaveRequest, save_alone


def test_a_rank_sees_rank_0s_mark_only_in_the_same_directory(tmp_path):
    shared, other = tmp_path / "a" / "t.tmp", tmp_path / "b" / "t.tmp"
    save_id = sharing.write_mark(str(shared))
    assert sharing.mark_problem(str(shared), save_id, wait_s=0) is None
    start = time.monotonic()
    assert sharing.mark_problem(str(other), save_id, wait_s=0.2) == f"finds no {other}/"
    assert time.monotonic() - start >= 0.2  # it waited for a late file first
    sharing.write_mark(str(other))  # an earlier save's TAG.tmp/ on that host
    assert sharing.mark_problem(str(other), save_id, wait_s=0) == \
        f"finds another save's {other / SAVE_ID}"


def test_the_save_error_names_the_ranks_by_host():
    hosts = ["node1", "node1", "node2", "node2", "node3"]
    text = sharing.not_shared("/ck", "global_step2",
                              [None, None, "finds no /ck/global_step2.tmp/", "x", "y"], hosts)
    assert text.startswith("the checkpoint directory /ck is not shared between hosts, or its "
                           "file system shows other hosts' files late: ranks 2, 3 (host node2); "
                           "rank 4 (host node3) cannot see the global_step2.tmp/ that rank 0 "
                           "(host node1) created there, within 2 s (rank 2 finds no "
                           "/ck/global_step2.tmp/; rank 3 x; rank 4 y)"), text
    assert text.endswith("Nothing was written; the previous checkpoint is intact")
    assert "use_node_local_storage is not supported" in text


def test_the_latest_error_says_which_rank_read_what():
    text = sharing.different_latest(["global_step4", None], ["node1", "node2"], "/ck")
    assert text.startswith("the ranks read different 'latest' files (rank 0 (host node1) reads "
                           "'global_step4' from /ck/latest; rank 1 (host node2) finds no "
                           "/ck/latest): is /ck one directory on a file system every rank "
                           "shares? Load from a shared directory, or pass the same tag="), text


def test_many_hosts_are_counted_not_listed():
    hosts = [f"n{i}" for i in range(20)]
    text = sharing.on_hosts(list(range(20)), hosts)
    assert text.endswith("rank 7 (host n7); and 12 more hosts"), text


def _exports() -> list[ExportedState]:
    weight = torch.arange(4, dtype=torch.float32)
    return [ExportedState({"w": TensorInfo("w", (4,), torch.float32)},
                          (Fragment("w", 0, 4, weight),))]


def test_the_mark_is_not_part_of_the_checkpoint_and_stale_marks_are_cleared(tmp_path):
    out = save_alone(SaveRequest(str(tmp_path), "t"), _exports())
    assert SAVE_ID not in os.listdir(out)
    stale = tmp_path / "old.tmp"  # an interrupted save: rank 0's mark and nothing else
    sharing.write_mark(str(stale))
    os.utime(stale / SAVE_ID, (0, 0))
    os.utime(stale, (0, 0))
    assert remove_stale_saves(str(tmp_path), "t", 1.0) == ["old"]


def test_the_load_line_counts_the_saving_ranks_in_english(tmp_path, caplog):
    from dsrun.runtime.checkpoint.coord import Coordinator
    from dsrun.runtime.checkpoint.reader import LoadRequest, load_state
    from tests.unit.test_checkpoint_io import DictSource

    save_alone(SaveRequest(str(tmp_path), "t"), _exports())
    with caplog.at_level(logging.INFO, logger="dsrun.runtime.checkpoint"):
        load_state(LoadRequest(str(tmp_path)), [DictSource({"w": torch.zeros(4)})], {},
                   Coordinator(5))
    assert f"loaded checkpoint {tmp_path / 't'} (saved by 1 rank)" in caplog.text, caplog.text


class Rank1:
    """Rank 1 (or 0) of two in :func:`sharing.check_save_shared`, its
    exchange recorded."""

    def __init__(self, timeout_s: float, rank: int = 1, other: Optional[str] = None) -> None:
        self.rank, self.world, self.timeout_s = rank, 2, timeout_s
        self.other = other  # what the other rank posts
        self.sent: list[Any] = []

    def exchange(self, obj: Any) -> list[Any]:
        self.sent.append(obj)
        return [self.other, obj] if self.rank == 1 else [obj, self.other]


def test_the_wait_for_the_mark_grows_with_the_timeout_up_to_30_s():
    assert sharing.mark_wait_s(600) == 30.0  # the default checkpoint.timeout
    assert sharing.mark_wait_s(20) == 5.0


def test_a_mark_that_shows_late_is_waited_for_relisting_the_directory(
        tmp_path, monkeypatch, caplog):
    """A network file system can show rank 0's new TAG.tmp/ late (NFS: for
    acdirmin, 30 s): rank 1 keeps looking, listing the directories (which
    makes an NFS client revalidate its cached entries), and says it waits."""
    tmp_dir = tmp_path / "t.tmp"
    listed: list[str] = []
    real = os.listdir
    monkeypatch.setattr(sharing.os, "listdir", lambda p: listed.append(str(p)) or real(p))
    save_id = "0123abcd"

    def late() -> None:
        time.sleep(2.6)
        tmp_dir.mkdir()
        (tmp_dir / SAVE_ID).write_text(save_id)

    writer = threading.Thread(target=late)
    writer.start()
    coord = Rank1(600.0)
    start = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="dsrun.runtime.checkpoint"):
        sharing.check_save_shared(coord, str(tmp_dir), save_id, str(tmp_path), "t", ["a", "b"])
    writer.join()
    assert 2.6 <= time.monotonic() - start < 5, "it waited for the late mark, not much longer"
    assert coord.sent == [None]
    assert str(tmp_path) in listed, listed
    note = f"rank 1 does not see rank 0's {tmp_dir / SAVE_ID} yet (it finds no {tmp_dir}/); "
    assert re.search(re.escape(note) + r"waiting up to 2\d s more: a network file system can "
                     "show another host's new file late", caplog.text), caplog.text


def test_a_rank_that_does_not_see_the_mark_removes_nothing(tmp_path):
    """Rank 1's TAG.tmp/ without rank 0's mark may be a stale view of the
    shared directory (an NFS entry still naming what the last commit renamed
    to TAG/): only rank 0 removes TAG.tmp/, so the error stays true."""
    tmp_dir = tmp_path / "t.tmp"
    tmp_dir.mkdir()
    (tmp_dir / "manifest.json").write_text("{}")
    (tmp_dir / "rank_00000.bin").write_bytes(b"data")
    coord = Rank1(0.4)
    with pytest.raises(CheckpointError, match=r"rank 1 \(host b\) cannot see the t.tmp/ .*"
                                              r"the previous checkpoint is intact"):
        sharing.check_save_shared(coord, str(tmp_dir), "0123abcd", str(tmp_path), "t",
                                  ["a", "b"])
    assert coord.sent == [f"finds {tmp_dir}/ without {SAVE_ID}"]
    assert sorted(os.listdir(tmp_dir)) == ["manifest.json", "rank_00000.bin"]


def test_a_garbled_mark_fails_the_save_on_every_rank_through_the_exchange(tmp_path):
    """A mark that is not UTF-8 is reported in the exchange (the other ranks
    wait in it), and every rank raises the same error."""
    tmp_dir = tmp_path / "t.tmp"
    tmp_dir.mkdir()
    (tmp_dir / SAVE_ID).write_bytes(b"\xff\xfe\x00garbled")
    coord = Rank1(0.4)
    with pytest.raises(CheckpointError, match=r"is not shared between hosts.*rank 1 finds an "
                                              r"unreadable .*save_id \('utf-8' codec"):
        sharing.check_save_shared(coord, str(tmp_dir), "0123abcd", str(tmp_path), "t",
                                  ["a", "b"])
    assert len(coord.sent) == 1 and coord.sent[0].startswith("finds an unreadable"), coord.sent
    assert os.listdir(tmp_dir) == [SAVE_ID]


def test_rank_0_removes_the_tmp_dir_it_made_when_another_rank_cannot_see_it(tmp_path):
    tmp_dir = tmp_path / "t.tmp"
    save_id = sharing.write_mark(str(tmp_dir))

    coord = Rank1(8.0, rank=0, other=f"finds no {tmp_dir}/")
    with pytest.raises(CheckpointError, match=r"within 2 s \(rank 1 finds no "):
        sharing.check_save_shared(coord, str(tmp_dir), save_id, str(tmp_path), "t", ["a", "b"])
    assert coord.sent == [None] and not tmp_dir.exists()
