"""A checkpoint agreement notices the last rank's key soon after it is set
(coord.py): the polling back-off must not hold a save up to half a second
(the old back-off noticed these keys 0.28 s and 0.43 s late; now <= 50 ms,
the bound leaves room for a loaded machine)."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import torch.distributed as dist

from dsrun.runtime.checkpoint.coord import Coordinator, post_arrival


def test_a_late_peer_s_key_is_seen_within_0_2_s() -> None:
    store = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=timedelta(seconds=10))
    coord = Coordinator(timeout_s=10.0)
    coord.world = 2
    posted: list[float] = []
    delays = []
    for late in (0.35, 0.7):  # past the old back-off's 0.31 s and 0.63 s polls
        prefix = f"dsrun/checkpoint/latency-{late}/"
        post_arrival(store, prefix, 0, {})
        posted.clear()

        def peer() -> None:
            time.sleep(late)  # noqa: B023 - joined within the iteration
            post_arrival(store, prefix, 1, {})  # noqa: B023
            posted.append(time.monotonic())

        thread = threading.Thread(target=peer)
        thread.start()
        coord._wait_all(store, prefix, "engine.save_checkpoint()")
        returned = time.monotonic()
        thread.join()
        delays.append(returned - posted[0])
    assert max(delays) < 0.2, f"the agreement noticed the last key {delays} s late"
