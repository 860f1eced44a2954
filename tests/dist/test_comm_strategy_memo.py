"""``zero.comm.strategy_for`` remembers each live process group's strategy
per device type (stage 3 asks for every gradient; before, each call read
and parsed the group's backend config), holds no destroyed group, and a
new default group after ``destroy_process_group`` is asked afresh."""

from __future__ import annotations

import gc
from typing import Any

import pytest
import torch
import torch.distributed as dist

from dsrun.runtime.zero import comm

pytestmark = pytest.mark.dist


def counting(monkeypatch: pytest.MonkeyPatch, answer: Any = None) -> list[Any]:
    calls: list[Any] = []
    real = dist.get_backend_config

    def config(group: Any = None) -> str:
        calls.append(group)
        return real(group) if answer is None else answer

    monkeypatch.setattr(dist, "get_backend_config", config)
    return calls


def test_a_groups_strategy_is_read_once_per_device_type(solo: None,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    calls = counting(monkeypatch)
    cpu = torch.device("cpu")
    group = dist.new_group([0])
    first = [comm.strategy_for(group, cpu) for _ in range(3)]
    assert first == [comm.STRATEGIES["gloo"]] * 3 and len(calls) == 1
    comm.strategy_for(None, cpu)  # the default group is another group
    comm.strategy_for(None, cpu)
    comm.strategy_for(dist.group.WORLD, cpu)  # ... the same as None
    comm.strategy_for(group, None)  # another device type
    assert len(calls) == 3


def test_no_destroyed_group_is_held_and_a_new_default_group_is_asked(
        monkeypatch: pytest.MonkeyPatch) -> None:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        assert comm.strategy_for(None, torch.device("cpu")) == comm.STRATEGIES["gloo"]
        old = dist.group.WORLD
        assert old in comm._strategies
    finally:
        dist.destroy_process_group()
    del old
    gc.collect()
    assert len(comm._strategies) == 0
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:  # as if the new default group had nccl's config: it is read, not remembered
        calls = counting(monkeypatch, answer="cuda:nccl")
        assert comm.strategy_for(None, torch.device("cpu")) == comm.STRATEGIES["nccl"]
        assert len(calls) == 1
    finally:
        dist.destroy_process_group()
