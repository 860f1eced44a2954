"""Bucket assignment for the gradient all-reduce (pure) and the bucket-size rule."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dsrun.runtime.config import resolve
from dsrun.runtime.engine_setup import bucket_elements
from dsrun.runtime.grad_sync import assign_buckets


def test_fills_buckets_in_order_up_to_the_cap() -> None:
    # 4-byte elements, 40-byte cap: 10 elements per bucket
    assert assign_buckets([4, 4, 4, 6, 10], [4] * 5, ["f32"] * 5, 40) == [[0, 1], [2, 3], [4]]


def test_oversized_parameter_gets_its_own_bucket() -> None:
    assert assign_buckets([2, 100, 2], [4] * 3, ["f32"] * 3, 40) == [[0], [1], [2]]


def test_one_dtype_per_bucket() -> None:
    got = assign_buckets([1, 1, 1, 1], [4, 2, 4, 2], ["f32", "f16", "f32", "f16"], 1000)
    assert got == [[0, 2], [1, 3]]


def test_everything_in_one_bucket_when_it_fits() -> None:
    assert assign_buckets([3, 5, 7], [4] * 3, ["f32"] * 3, 10**9) == [[0, 1, 2]]


def test_bad_arguments() -> None:
    with pytest.raises(ValueError):
        assign_buckets([1], [4], ["f32"], 0)
    with pytest.raises(ValueError):
        assign_buckets([1, 2], [4], ["f32"], 10)


@given(st.lists(st.tuples(st.integers(1, 50), st.sampled_from([("f32", 4), ("f16", 2)])),
                max_size=40),
       st.integers(1, 200))
def test_partition_properties(params: list, cap: int) -> None:
    numels = [n for n, _ in params]
    dtypes = [d for _, (d, _) in params]
    sizes = [s for _, (_, s) in params]
    buckets = assign_buckets(numels, sizes, dtypes, cap)
    flat = sorted(i for b in buckets for i in b)
    assert flat == list(range(len(params)))  # every index exactly once
    assert [b[0] for b in buckets] == sorted(b[0] for b in buckets)
    for bucket in buckets:
        assert bucket == sorted(bucket)  # order kept inside a bucket
        assert len({dtypes[i] for i in bucket}) == 1
        nbytes = sum(numels[i] * sizes[i] for i in bucket)
        assert nbytes <= cap or len(bucket) == 1


def _cfg(**extra: object):
    return resolve({"train_batch_size": 2, **extra}, dp_size=2, dp_source="test", environ={})


def test_bucket_size_from_config() -> None:
    assert bucket_elements(_cfg()) is None  # DeepSpeed's 5e8 default: use 25 MiB
    assert bucket_elements(_cfg(zero_optimization={"reduce_bucket_size": 1000})) == 1000
    assert bucket_elements(_cfg(zero_optimization={"reduce_bucket_size": "auto"})) is None
    both = _cfg(zero_optimization={"reduce_bucket_size": 1000},
                dsrun={"allreduce_bucket_size": 77})
    assert bucket_elements(both) == 77
