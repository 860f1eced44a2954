"""The checks that a checkpoint directory is one directory every rank
shares (dsrun/runtime/checkpoint/sharing.py), the pieces that need no
second process; tests/proc/test_checkpoint_nodelocal.py runs them on two
ranks."""

from __future__ import annotations

import logging
import os
import time

import torch

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
    assert text.startswith("the checkpoint directory /ck is not shared between hosts: ranks 2, "
                           "3 (host node2); rank 4 (host node3) cannot see the global_step2.tmp/ "
                           "that rank 0 (host node1) created there (rank 2 finds no "
                           "/ck/global_step2.tmp/; rank 3 x; rank 4 y)"), text
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
