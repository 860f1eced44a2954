"""A checkpoint agreement's wait costs rank 0's store the same per poll at
any world size (coord.py): it polled ``store.check`` on every rank's key,
``world`` lookups per rank per poll (about 20 million a second at 1024
ranks); now one counter key. What the agreement returns and its errors
naming missing ranks are unchanged."""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from typing import Any

import pytest
import torch.distributed as dist

from dsrun.errors import CheckpointError
from dsrun.runtime.checkpoint import coord as coord_mod
from dsrun.runtime.checkpoint.coord import Coordinator, post_arrival


class CountingStore:
    """A TCPStore that counts the keys each call looks at."""

    def __init__(self, store: Any) -> None:
        self.store = store
        self.lookups = 0
        self.polling = False

    def check(self, keys: list[str]) -> bool:
        if self.polling:
            self.lookups += len(keys)
        return self.store.check(keys)

    def add(self, key: str, n: int) -> int:
        if self.polling:
            self.lookups += 1
        return self.store.add(key, n)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.store, name)


def _store() -> Any:
    return dist.TCPStore("127.0.0.1", 0, 1, True, timeout=timedelta(seconds=10))


def _lookups_while_waiting(world: int, monkeypatch: pytest.MonkeyPatch) -> int:
    monkeypatch.setattr(coord_mod.exitmark, "job_store", lambda: None)
    store = CountingStore(_store())
    coord = Coordinator(timeout_s=10.0)
    coord.world = world
    prefix = f"dsrun/checkpoint/cost-{world}/"
    for rank in range(world - 1):
        post_arrival(store, prefix, rank, {"rank": rank})

    def last() -> None:
        time.sleep(0.4)
        post_arrival(store, prefix, world - 1, {"rank": world - 1})

    thread = threading.Thread(target=last)
    thread.start()
    store.polling = True
    coord._wait_all(store, prefix, "engine.save_checkpoint()")
    store.polling = False
    thread.join()
    return store.lookups


def test_the_wait_looks_up_as_many_keys_at_256_ranks_as_at_2(monkeypatch) -> None:
    small = _lookups_while_waiting(2, monkeypatch)
    large = _lookups_while_waiting(256, monkeypatch)
    # ~15 polls in 0.4 s, plus the exit watch's counter: a few dozen lookups
    # either way (polling every rank's key: 15 x 256 = ~3800)
    assert large < 100, f"{large} store lookups while 256 ranks' keys came in"
    assert large < 3 * small + 20, (small, large)


def test_a_missing_rank_is_still_named_at_the_timeout(monkeypatch) -> None:
    monkeypatch.setattr(coord_mod.exitmark, "job_store", lambda: None)
    store = _store()
    coord = Coordinator(timeout_s=0.3)
    coord.world = 4
    prefix = "dsrun/checkpoint/missing/"
    for rank in (0, 1, 3):
        post_arrival(store, prefix, rank, {})
    with pytest.raises(CheckpointError, match=r"called on ranks 0, 1, 3 but rank 2 did not"):
        coord._wait_all(store, prefix, "engine.save_checkpoint()")


def test_agree_returns_every_rank_s_payload_in_rank_order(monkeypatch) -> None:
    monkeypatch.setattr(coord_mod.exitmark, "job_store", lambda: None)
    store = _store()
    coord = Coordinator(timeout_s=5.0)
    coord.world = 3
    monkeypatch.setattr(coord, "_store", lambda: store)
    monkeypatch.setattr(coord, "_check_reachable", lambda store: None)
    call = next(coord_mod._calls) + 1  # the number agree() takes next
    prefix = f"dsrun/checkpoint/{call}/"
    for rank in (2, 1):
        post_arrival(store, prefix, rank, {"tag": f"t{rank}"})
    assert coord.agree("engine.save_checkpoint()", {"tag": "t0"}) == \
        [{"tag": "t0"}, {"tag": "t1"}, {"tag": "t2"}]
