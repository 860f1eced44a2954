"""rendezvous.job_store: a dsrun job's store refuses another job's ranks.

Real TCPStores on loopback, in this process: rank 0 of a job whose port is
already hosted by another job's store (or another program), and ranks that
connect to a store.
"""

from __future__ import annotations

import datetime
import socket

import pytest
import torch.distributed as dist

from dsrun.errors import DsrunError
from dsrun.launcher.netinfo import bind_below_ephemeral
from dsrun.runtime import rendezvous
from dsrun.runtime.env import DistEnv

WAIT = datetime.timedelta(seconds=20)


def _free_port() -> int:
    """A free port below the ephemeral range, as dsrun picks them (no other
    program's outgoing connection takes it meanwhile)."""
    with socket.socket() as s:
        bind_below_ephemeral(s)
        return int(s.getsockname()[1])


def _env(rank: int, port: int, job: str) -> DistEnv:
    return DistEnv(rank=rank, world_size=2, master_addr="127.0.0.1", master_port=port,
                   job_id=job, source="dsrun")


def test_own_job_store_is_joined_and_another_jobs_is_refused():
    port = _free_port()
    master = rendezvous.job_store(_env(0, port, "job-a"), WAIT)
    assert bytes(master.get(rendezvous.JOB_KEY)) == b"job-a"
    client = rendezvous.job_store(_env(1, port, "job-a"), WAIT)
    client.set("k", "v")
    assert bytes(master.get("k")) == b"v"
    with pytest.raises(DsrunError) as err:
        rendezvous.job_store(_env(1, port, "job-b"), WAIT)
    text = str(err.value)
    assert f"127.0.0.1:{port}" in text and "dsrun job job-a" in text and "(job-b)" in text


def test_rank0_that_lost_the_port_names_it_and_the_job_holding_it():
    port = _free_port()
    # as another process's store: job_store's multi-tenant master would share
    # a multi-tenant server of this process instead of binding
    holder = dist.TCPStore("127.0.0.1", port, 2, True, wait_for_workers=False)
    holder.set(rendezvous.JOB_KEY, "job-a")
    with pytest.raises(DsrunError) as err:
        rendezvous.job_store(_env(0, port, "job-b"), WAIT)
    text = str(err.value)
    assert f"port {port} on 127.0.0.1" in text and "taken by dsrun job job-a" in text
    assert "--master_port" in text
    assert bytes(holder.get(rendezvous.JOB_KEY)) == b"job-a"  # the holder is untouched


def test_rank0_that_lost_the_port_to_another_program_says_so(monkeypatch):
    monkeypatch.setattr(rendezvous, "OWNER_WAIT", datetime.timedelta(seconds=0.5))
    port = _free_port()
    with socket.socket() as other:  # listening, never answering as a store
        other.bind(("127.0.0.1", port))
        other.listen()
        with pytest.raises(DsrunError) as err:
            rendezvous.job_store(_env(0, port, "job-b"), WAIT)
    assert f"port {port} on 127.0.0.1" in str(err.value)
    assert "another program (or another dsrun job)" in str(err.value)


def test_store_without_a_job_id_is_refused(monkeypatch):
    monkeypatch.setattr(rendezvous, "JOB_KEY_WAIT", datetime.timedelta(seconds=1))
    port = _free_port()
    plain = dist.TCPStore("127.0.0.1", port, 2, True, wait_for_workers=False)
    with pytest.raises(DsrunError, match="another program"):
        rendezvous.job_store(_env(1, port, "job-b"), WAIT)
    del plain
