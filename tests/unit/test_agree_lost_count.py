"""A checkpoint agreement whose counter is short of a rank that did post
its key (coord.py: killed between its ``store.set`` and ``store.add``)
does not wait out ``checkpoint.timeout`` and raise naming no rank ("ranks
 did not call it"): the rank's exit mark, or the deadline, ends the wait
with every key readable. Rank 0 also deletes the counter key of the call
two before, which no other rank touches."""

from __future__ import annotations

import json
import time
from datetime import timedelta
from typing import Any

import pytest
import torch.distributed as dist

from dsrun.runtime import exitmark
from dsrun.runtime.checkpoint import coord as coord_mod
from dsrun.runtime.checkpoint.coord import ARRIVED, Coordinator, post_arrival

SAVE = "engine.save_checkpoint()"


@pytest.fixture
def store(monkeypatch) -> Any:
    monkeypatch.setattr(coord_mod.exitmark, "job_store", lambda: None)  # exit marks: here
    return dist.TCPStore("127.0.0.1", 0, 1, True, timeout=timedelta(seconds=10))


def _key_without_count(store: Any, prefix: str, rank: int) -> None:
    store.set(prefix + str(rank), json.dumps({"rank": rank}))


def test_a_rank_killed_before_counting_itself_in_ends_the_wait_at_its_exit_mark(store):
    coord = Coordinator(timeout_s=4.0)
    coord.world = 3
    prefix = "dsrun/checkpoint/killed-after-set/"
    for rank in (0, 1):
        post_arrival(store, prefix, rank, {"rank": rank})
    _key_without_count(store, prefix, 2)
    store.set(f"{exitmark.PREFIX}2", json.dumps({"status": 137, "during": None,
                                                 "signal": "SIGKILL", "by": "agent"}))
    store.add(exitmark.COUNT_KEY, 1)
    start = time.monotonic()
    coord._wait_all(store, prefix, SAVE)  # returns: rank 2's key can be read
    assert time.monotonic() - start < 2.0
    assert coord._broken is None


def test_every_key_posted_at_the_deadline_is_not_a_timeout_naming_no_rank(store):
    coord = Coordinator(timeout_s=0.3)
    coord.world = 3
    prefix = "dsrun/checkpoint/no-count-no-mark/"
    post_arrival(store, prefix, 0, {})
    _key_without_count(store, prefix, 1)
    _key_without_count(store, prefix, 2)
    coord._wait_all(store, prefix, SAVE)
    assert coord._broken is None


def _agree_three_times(coord: Coordinator, store: Any, other: int) -> int:
    """Three agreements of ``coord`` with rank ``other``'s keys posted
    ahead; the number of the first."""
    first = next(coord_mod._calls) + 1  # the number agree() takes next
    for call in range(first, first + 3):
        post_arrival(store, f"dsrun/checkpoint/{call}/", other, {"tag": "t"})
    for _ in range(3):
        assert coord.agree(SAVE, {"tag": "t"}) == [{"tag": "t"}] * 2
    return first


@pytest.mark.parametrize("rank", [0, 1])
def test_rank_0_alone_deletes_the_counter_of_the_call_two_before(store, monkeypatch, rank):
    coord = Coordinator(timeout_s=5.0)
    coord.world, coord.rank = 2, rank
    monkeypatch.setattr(coord, "_store", lambda: store)
    monkeypatch.setattr(coord, "_check_reachable", lambda store: None)
    first = _agree_three_times(coord, store, 1 - rank)
    counter = f"dsrun/checkpoint/{first}/{ARRIVED}"
    assert store.check([counter]) == (rank != 0)
    assert not store.check([f"dsrun/checkpoint/{first}/{rank}"])  # its own key: gone
    assert store.check([f"dsrun/checkpoint/{first + 1}/{ARRIVED}"])  # still in use
