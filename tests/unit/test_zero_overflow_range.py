"""The ZeRO overflow test's range: a value that would round to inf in the
model dtype (masters.overflow_limit / in_range) is out, as a cast says."""

from __future__ import annotations

import math

import pytest
import torch

from dsrun.runtime.zero.masters import in_range, overflow_limit


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_the_limit_is_where_a_cast_becomes_inf(dtype: torch.dtype) -> None:
    limit = torch.tensor(overflow_limit(dtype), dtype=torch.float32)
    below = torch.nextafter(limit, torch.tensor(0.0))
    assert torch.isinf(limit.to(dtype)) and torch.isfinite(below.to(dtype))
    assert overflow_limit(torch.float16) == 65520.0


@pytest.mark.parametrize("dtype", [None, torch.float32, torch.float64])
def test_fp32_and_wider_only_exclude_inf_and_nan(dtype: torch.dtype) -> None:
    assert overflow_limit(dtype) == math.inf
    assert bool(in_range([torch.tensor([3e38, -3e38])], math.inf))


def test_in_range_sees_magnitude_inf_and_nan_in_any_tensor() -> None:
    limit = overflow_limit(torch.float16)
    ok = torch.tensor([65519.0, -65519.0, 0.0])
    assert bool(in_range([ok, ok], limit))
    for bad in (65520.0, -1e5, math.inf, -math.inf, math.nan):
        worse = torch.tensor([1.0, bad, 2.0])
        assert not bool(in_range([ok, worse], limit)), bad
