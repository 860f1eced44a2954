"""The node agent's exit marks (launcher/agent_marks.py): its own client of
torch's TCPStore posts a mark that torch's client and exitmark.ExitWatch
read back, on the libuv and on the classic server, once only, and counts a
rank whose own key got there without its count; only into the store of
its own job (not another job's, not a listener that is no store); a store
that is gone or never answers costs a bounded time; a mark still being
posted when the agent's process ends is waited for; and which ranks'
environments have a store to post to."""

from __future__ import annotations

import datetime
import os
import socket
import subprocess
import sys
import threading
import time

import pytest
import torch.distributed as dist

from dsrun.launcher.agent_marks import (
    COUNTED,
    POSTED,
    REFUSED,
    STORE_WAIT_S,
    UNREACHABLE,
    StoreAddress,
    mark_if_unmarked,
    mark_value,
    marked_file,
    post_mark,
    store_address,
    wait_for_marks,
)
from dsrun.runtime.exitmark import COUNT_KEY, ExitWatch, describe_exit
from dsrun.runtime.rendezvous import JOB_KEY
from tests.conftest import ROOT

JOB = "a1b2c3d4e5f60718"


def _store(libuv: bool = True, job_id: str | None = JOB) -> dist.TCPStore:
    store = dist.TCPStore("127.0.0.1", 0, 2, True, wait_for_workers=False, use_libuv=libuv,
                          timeout=datetime.timedelta(seconds=5))
    if job_id is not None:
        store.set(JOB_KEY, job_id)  # as rendezvous.py's rank 0 does
    return store


def _listener(answer: bytes | None) -> tuple[socket.socket, list[bytes]]:
    """A program on the port that is no store: it answers each connection
    with ``answer`` (None: never) and keeps what it was sent."""
    server = socket.create_server(("127.0.0.1", 0))
    got: list[bytes] = []

    def serve() -> None:
        conn, _ = server.accept()
        with conn:
            conn.settimeout(5)
            try:
                got.append(conn.recv(65536))
                if answer is not None:
                    conn.sendall(answer)
                while data := conn.recv(65536):
                    got.append(data)
            except OSError:
                pass

    threading.Thread(target=serve, daemon=True).start()
    return server, got


@pytest.mark.parametrize("libuv", [True, False], ids=["libuv", "classic"])
def test_the_agent_s_mark_is_read_by_torch_and_by_the_waiters(libuv):
    store = _store(libuv)
    watch = ExitWatch(store, 3)
    assert watch.poll() == {}
    assert post_mark(StoreAddress("127.0.0.1", store.port, JOB), 2, -9) == POSTED
    assert watch.poll() == {2: {"status": 137, "during": None, "signal": "SIGKILL",
                                "by": "agent"}}
    assert int(store.add(COUNT_KEY, 0)) == 1
    assert describe_exit(2, watch.exited[2]) == "rank 2 exited (status 137: killed by SIGKILL)"
    # there already (posted, or the rank's own set whose add may be missing):
    # counted again, never overwritten
    assert post_mark(StoreAddress("127.0.0.1", store.port, JOB), 2, 0) == COUNTED
    assert watch.poll()[2]["status"] == 137


@pytest.mark.parametrize("libuv", [True, False], ids=["libuv", "classic"])
def test_a_rank_s_own_key_without_its_count_is_counted(libuv):
    # The rank's set reached the store, its add did not (it gave up after
    # MARK_WAIT_S and wrote no marked file): the waiters read keys only
    # when the count grows, so they would never see this exit.
    store = _store(libuv)
    watch = ExitWatch(store, 2)
    assert watch.poll() == {}
    store.set("dsrun/exited/1", '{"status": 0, "during": null}')
    assert watch.poll() == {}
    assert post_mark(StoreAddress("127.0.0.1", store.port, JOB), 1, 0) == COUNTED
    assert watch.poll() == {1: {"status": 0, "during": None}}


@pytest.mark.parametrize("owner", ["another job", "no job"])
def test_another_job_s_store_gets_no_mark(owner):
    # two jobs given one --master_port at once: the port is the other job's
    store = _store(job_id="f00dfeedf00dfeed" if owner == "another job" else None)
    assert post_mark(StoreAddress("127.0.0.1", store.port, JOB), 1, 1) == REFUSED
    assert not store.check(["dsrun/exited/1"]) and not store.check([COUNT_KEY])


@pytest.mark.parametrize("answer", [b"HTTP/1.0 400 Bad Request\r\n\r\n",
                                    b"\x00" + b"\xff" * 64], ids=["http", "zero-then-junk"])
def test_a_listener_that_is_no_store_gets_no_mark(answer):
    server, got = _listener(answer)
    with server:
        start = time.monotonic()
        address = StoreAddress("127.0.0.1", server.getsockname()[1], JOB)
        assert post_mark(address, 1, 1) == REFUSED
        assert time.monotonic() - start < 1.0
        time.sleep(0.1)
    sent = b"".join(got)
    assert b"dsrun/exited" not in sent and b"agent" not in sent, sent


def test_a_store_that_is_gone_or_never_answers_costs_a_bounded_time():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    start = time.monotonic()
    assert post_mark(StoreAddress("127.0.0.1", port, JOB), 1, 0) == UNREACHABLE
    assert time.monotonic() - start < 1.0  # refused: at once
    server, got = _listener(None)
    with server:
        start = time.monotonic()
        assert post_mark(StoreAddress("127.0.0.1", server.getsockname()[1], JOB), 1, 0) \
            == UNREACHABLE
        assert STORE_WAIT_S - 0.1 < time.monotonic() - start < STORE_WAIT_S + 1.0
        assert b"dsrun/exited" not in b"".join(got)


def test_waiting_for_marks_is_bounded(tmp_path):
    server, _ = _listener(None)
    with server:
        address = StoreAddress("127.0.0.1", server.getsockname()[1], JOB)
        assert mark_if_unmarked(address, str(tmp_path), 1, 0) is not None
        start = time.monotonic()
        assert wait_for_marks(0.3) is False
        assert time.monotonic() - start < 1.0
        assert wait_for_marks(STORE_WAIT_S + 1.0) is True


def _slow_proxy(port: int, delay: float) -> socket.socket:
    """A port that passes one connection on to ``port`` after ``delay`` s."""
    server = socket.create_server(("127.0.0.1", 0))

    def pipe(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            dst.close()

    def serve() -> None:
        conn, _ = server.accept()
        time.sleep(delay)
        upstream = socket.create_connection(("127.0.0.1", port))
        threading.Thread(target=pipe, args=(upstream, conn), daemon=True).start()
        pipe(conn, upstream)

    threading.Thread(target=serve, daemon=True).start()
    return server


def test_a_mark_still_being_posted_when_the_agent_ends_gets_there(tmp_path):
    # The rank that left was its host's last: the agent ends right after
    # its exit; the posting thread must not be cut short with it.
    store = _store()
    with _slow_proxy(store.port, 0.5) as proxy:
        code = ("import sys; from dsrun.launcher.agent_marks import StoreAddress, "
                "mark_if_unmarked; mark_if_unmarked(StoreAddress('127.0.0.1', "
                f"{proxy.getsockname()[1]}, {JOB!r}), sys.argv[1], 1, -9)")
        subprocess.run([sys.executable, "-c", code, str(tmp_path)], cwd=ROOT, check=True,
                       timeout=30, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert ExitWatch(store, 2).poll() == {1: {"status": 137, "during": None,
                                              "signal": "SIGKILL", "by": "agent"}}


def test_which_ranks_have_a_store_and_need_a_mark(tmp_path):
    env = {"MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500", "WORLD_SIZE": "4",
           "DSRUN_JOB_ID": JOB}
    assert store_address(env) == StoreAddress("10.0.0.1", 29500, JOB)
    assert store_address({**env, "DSRUN_DIST_BACKEND": "none"}) is None
    assert store_address({**env, "WORLD_SIZE": "1"}) is None
    assert store_address({**env, "MASTER_PORT": "<chosen at launch>"}) is None
    assert store_address({k: v for k, v in env.items() if k != "MASTER_ADDR"}) is None
    # not a dsrun job's store: nothing in it says whose it is
    assert store_address({k: v for k, v in env.items() if k != "DSRUN_JOB_ID"}) is None
    assert mark_value(3) == {"status": 3, "during": None, "by": "agent"}
    open(marked_file(str(tmp_path), 1), "w").close()  # the rank posted its own
    assert mark_if_unmarked(StoreAddress("127.0.0.1", 1, JOB), str(tmp_path), 1, 0) is None
    assert mark_if_unmarked(None, str(tmp_path), 2, 0) is None
    assert not os.path.exists(marked_file(str(tmp_path), 2))


def test_an_address_that_cannot_be_encoded_is_refused_quietly():
    assert post_mark(StoreAddress("a" * 64 + ".example", 29500, JOB), 1, 0) == REFUSED
