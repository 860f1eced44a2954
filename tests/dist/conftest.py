"""Fixtures shared by the distributed tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest


@pytest.fixture
def solo() -> Iterator[None]:
    """A one-rank gloo group in this process (no ports), destroyed after."""
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
