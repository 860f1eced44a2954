"""``deepspeed.runtime.utils``'s small helpers that scripts import:
set_random_seed, noop_context, move_to_device, partition_uniform and
partition_balanced, with DeepSpeed 0.19.8's results (its values for the
partitions were computed with DeepSpeed itself and agree on 3000 random
cases)."""

from __future__ import annotations

import random

import numpy
import pytest
import torch

from dsrun.runtime import utils as rt_utils


def test_set_random_seed_seeds_random_numpy_and_torch() -> None:
    draws = []
    for _ in range(2):
        rt_utils.set_random_seed(1234)
        draws.append((random.random(), numpy.random.rand(), torch.rand(1).item()))
    assert draws[0] == draws[1]
    rt_utils.set_random_seed(2**70 + 5)  # too large for numpy and torch: reduced, as DeepSpeed
    assert torch.initial_seed() == (2**70 + 5) % 2**63


def test_noop_context_does_nothing() -> None:
    with rt_utils.noop_context() as value:
        assert value is None


def test_move_to_device_through_containers() -> None:
    a, b = torch.ones(2), torch.zeros(1, dtype=torch.float64)
    moved = rt_utils.move_to_device({"x": [a, (b,)]}, "meta")
    assert moved["x"][0].device.type == "meta" and moved["x"][1][0].device.type == "meta"
    assert isinstance(moved["x"][1], tuple) and a.device.type == "cpu"
    # what criterion_func accepts moves in place: the caller's tensor itself
    c = torch.ones(3)
    assert rt_utils.move_to_device([c], torch.float64, lambda t: torch.is_tensor(t))[0] is c
    assert c.dtype == torch.float64


@pytest.mark.parametrize(("items", "parts", "bounds"), [
    (10, 4, [0, 3, 6, 8, 10]), (8, 4, [0, 2, 4, 6, 8]), (3, 3, [0, 1, 2, 3]),
    (2, 4, [0, 1, 2, 2, 2]), (0, 2, [0, 0, 0])])
def test_partition_uniform_as_deepspeed(items: int, parts: int, bounds: list[int]) -> None:
    assert rt_utils.partition_uniform(items, parts) == bounds


@pytest.mark.parametrize(("weights", "parts", "bounds"), [
    ([1, 2, 3, 4, 5, 6], 3, [0, 3, 5, 6]), ([5, 1, 1, 1, 1, 5], 2, [0, 3, 6]),
    ([3, 3, 3, 3], 3, [0, 2, 3, 4]), ([0, 0, 7, 1, 1, 1, 4], 3, [0, 3, 6, 7]),
    ([1, 1], 4, [0, 1, 2, 2, 2]), ([1, 9, 2, 5], 3, [0, 2, 3, 4])])
def test_partition_balanced_as_deepspeed(weights: list[int], parts: int,
                                         bounds: list[int]) -> None:
    """DeepSpeed's objective is the spread (heaviest minus lightest part),
    ties to the later cut: [1, 9, 2, 5] in 3 parts is 10 | 2 | 5, where
    dsrun's pipeline partitioning (the heaviest part) cuts 1 | 9 | 7."""
    assert rt_utils.partition_balanced(weights, parts) == bounds


def test_pipeline_partitioning_is_dsruns_own() -> None:
    from dsrun.runtime.pipe.partition import partition_balanced as pipeline_cut

    assert pipeline_cut([1, 9, 2, 5], 3) == (0, 1, 2, 4)


def test_deepspeed_import_path() -> None:
    from deepspeed.runtime.utils import (  # the alias finder
        move_to_device,
        noop_context,
        partition_balanced,
        partition_uniform,
        set_random_seed,
    )

    assert partition_uniform is rt_utils.partition_uniform
    assert (move_to_device, noop_context, partition_balanced, set_random_seed) == (
        rt_utils.move_to_device, rt_utils.noop_context, rt_utils.partition_balanced,
        rt_utils.set_random_seed)
