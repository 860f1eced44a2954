"""The process-wide ``F.linear`` swap of ZeRO stage 3
(dsrun/runtime/zero/linear.py), without an engine: holders released in
either order and twice, a wrapper installed before the swap is what
unmarked weights reach and what the last holder puts back, a replacement
made after the swap is left alone, marked weights save the parameter."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from dsrun.runtime.zero import linear

TORCH_LINEAR = linear._ORIGINAL  # torch's, whatever F.linear is when this is imported


@pytest.fixture(autouse=True)
def clean_swap() -> Iterator[None]:
    """Each test starts with torch's F.linear and no holders. What earlier
    tests in this process left (the swap of a stage-3 engine never
    destroyed) is set aside for the test and put back after it."""
    left = (F.linear, set(linear._swap.holders), linear._swap.saved)
    F.linear = TORCH_LINEAR
    linear._swap.holders.clear()
    linear._swap.saved = None
    try:
        yield
    finally:
        F.linear, linear._swap.saved = left[0], left[2]
        linear._swap.holders.clear()
        linear._swap.holders.update(left[1])


class Counting:
    """An ``F.linear`` wrapper (a profiler's or a quantisation shim's) that
    counts its calls and calls the function it wraps."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.calls = inner, 0

    def __call__(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        self.calls += 1
        return self.inner(*args, **kwargs)


@pytest.mark.parametrize("first_out", [0, 1])
def test_two_holders_in_either_order(first_out: int) -> None:
    holders = [linear.install(), linear.install()]
    assert F.linear is linear.zero3_linear and linear.holders() == 2
    linear.uninstall(holders[first_out])
    assert F.linear is linear.zero3_linear and linear.holders() == 1
    linear.uninstall(holders[1 - first_out])
    assert F.linear is TORCH_LINEAR and linear.holders() == 0


def test_releasing_twice_does_not_release_another_holder() -> None:
    first, second = linear.install(), linear.install()
    linear.uninstall(first)
    linear.uninstall(first)  # a double close: the second holder still holds
    assert F.linear is linear.zero3_linear and linear.holders() == 1
    linear.uninstall(second)
    linear.uninstall(second)
    assert F.linear is TORCH_LINEAR and linear.holders() == 0


def test_a_wrapper_installed_before_is_called_for_unmarked_weights_and_put_back() -> None:
    wrapper = Counting(TORCH_LINEAR)
    F.linear = wrapper
    holder = linear.install()
    x, w = torch.randn(3, 4), torch.randn(5, 4)
    out = F.linear(x, w)  # unmarked: the wrapper, not torch's function directly
    assert wrapper.calls == 1 and torch.equal(out, TORCH_LINEAR(x, w))
    linear.uninstall(holder)
    assert F.linear is wrapper


def test_a_replacement_made_after_the_swap_is_left_alone() -> None:
    holder = linear.install()
    later = Counting(linear.zero3_linear)
    F.linear = later
    linear.uninstall(holder)
    assert F.linear is later
    linear.install()  # a second swap replaces the wrapper, which calls the first
    assert linear._swap.saved is later
    x, w = torch.randn(3, 4), torch.randn(5, 4)
    assert torch.equal(F.linear(x, w), TORCH_LINEAR(x, w))  # no recursion
    assert later.calls == 1


def test_marked_weights_save_the_parameter_and_match_torch() -> None:
    holder = linear.install()
    try:
        torch.manual_seed(0)
        x = torch.randn(6, 4, requires_grad=True)
        w, b = torch.nn.Parameter(torch.randn(5, 4)), torch.nn.Parameter(torch.randn(5))
        plain = F.linear(x, w, b)
        assert type(plain.grad_fn).__name__ == "AddmmBackward0"  # unmarked: torch's
        grads_ref = torch.autograd.grad(plain.square().sum(), (x, w, b))
        linear.mark([w], True)
        out = F.linear(x, w, b)
        assert type(out.grad_fn).__name__ == "_Zero3LinearBackward"
        assert torch.equal(out, plain.detach())
        grads = torch.autograd.grad(out.square().sum(), (x, w, b))
        assert all(torch.equal(a, r) for a, r in zip(grads, grads_ref))
        with torch.no_grad():  # no graph: torch's
            assert F.linear(x, w, b).grad_fn is None
        linear.mark([w], False)
        assert type(F.linear(x, w, b).grad_fn).__name__ == "AddmmBackward0"
    finally:
        linear.uninstall(holder)
