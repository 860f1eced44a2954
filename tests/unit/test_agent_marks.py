"""The node agent's exit marks (launcher/agent_marks.py): its own client of
torch's TCPStore posts a mark that torch's client and exitmark.ExitWatch
read back, on the libuv and on the classic server, once only; and which
ranks' environments have a store to post to."""

from __future__ import annotations

import datetime
import os
import socket
import time

import pytest
import torch.distributed as dist

from dsrun.launcher.agent_marks import (
    mark_if_unmarked,
    mark_value,
    marked_file,
    post_mark,
    store_address,
)
from dsrun.runtime.exitmark import ExitWatch, describe_exit


@pytest.mark.parametrize("libuv", [True, False], ids=["libuv", "classic"])
def test_the_agent_s_mark_is_read_by_torch_and_by_the_waiters(libuv):
    store = dist.TCPStore("127.0.0.1", 0, 2, True, wait_for_workers=False, use_libuv=libuv,
                          timeout=datetime.timedelta(seconds=5))
    watch = ExitWatch(store, 3)
    assert watch.poll() == {}
    assert post_mark(("127.0.0.1", store.port), 2, -9) is True
    assert post_mark(("127.0.0.1", store.port), 2, 0) is False  # there already: once
    assert watch.poll() == {2: {"status": 137, "during": None, "signal": "SIGKILL",
                                "by": "agent"}}
    assert int(store.add("dsrun/exited/count", 0)) == 1
    assert describe_exit(2, watch.exited[2]) == "rank 2 exited (status 137: killed by SIGKILL)"
    store.set("dsrun/exited/1", '{"status": 0, "during": null}')  # the rank's own
    assert post_mark(("127.0.0.1", store.port), 1, 0) is False


def test_a_store_that_is_gone_costs_nothing():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    start = time.monotonic()
    assert post_mark(("127.0.0.1", port), 1, 0) is False
    assert time.monotonic() - start < 1.0


def test_which_ranks_have_a_store_and_need_a_mark(tmp_path):
    env = {"MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500", "WORLD_SIZE": "4"}
    assert store_address(env) == ("10.0.0.1", 29500)
    assert store_address({**env, "DSRUN_DIST_BACKEND": "none"}) is None
    assert store_address({**env, "WORLD_SIZE": "1"}) is None
    assert store_address({**env, "MASTER_PORT": "<chosen at launch>"}) is None
    assert store_address({k: v for k, v in env.items() if k != "MASTER_ADDR"}) is None
    assert mark_value(3) == {"status": 3, "during": None, "by": "agent"}
    open(marked_file(str(tmp_path), 1), "w").close()  # the rank posted its own
    assert mark_if_unmarked(("127.0.0.1", 1), str(tmp_path), 1, 0) is None
    assert mark_if_unmarked(None, str(tmp_path), 2, 0) is None
    assert not os.path.exists(marked_file(str(tmp_path), 2))
