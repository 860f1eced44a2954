"""Memory-efficient linear for ZeRO stage 3 (``memory_efficient_linear``).

``F.linear`` saves ``weight.t()`` for backward: a *view* of the gathered
weight, which keeps the full weight's storage alive from forward until
backward even after stage 3 released the parameter. :func:`zero3_linear`
computes the same forward (it calls the original ``F.linear``) but saves the
parameter object itself, as autograd does for any leaf: releasing it frees
the storage, and the stage-3 hook gathers it again before the layer's
backward. The backward uses the formulas autograd's ``AddmmBackward`` uses
for ``F.linear`` (``grad @ W``, ``grad^T @ x``, ``grad.sum(0)``), so
gradients agree with torch's bitwise for contiguous inputs.

**Which calls it takes.** Only weights :func:`mark` flagged (the
partitioned weights of a stage-3 model with ``memory_efficient_linear`` on,
not those kept whole, which are never released; which ones are kept whole
is fixed at initialize()), with grad enabled and outside autocast;
everything else goes to the ``F.linear`` the swap replaced. That decision
depends on the call alone, so an activation checkpoint's recomputation
takes the same path as the original forward and saves the same tensors -
torch's non-reentrant checkpoint requires it, and the recomputation may run
outside every hooked module (a checkpointed function calling ``F.linear(h,
self.head.weight)``).

**When it is installed.** ``torch.nn.functional.linear`` is
:func:`zero3_linear` from the first :func:`install` until the last holder's
:func:`uninstall` (a stage-3 model's fetcher holds it from its creation to
its ``close()``, which ``engine.destroy()`` calls; DeepSpeed keeps its own
for the rest of the process). A swap installed only around the root
module's forward would not cover a recomputation in backward. Unmarked
weights go to the ``F.linear`` the first :func:`install` replaced (torch's,
or a wrapper installed before it); the last :func:`uninstall` puts that one
back, unless something else has replaced :func:`zero3_linear` since.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterable
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F

_ORIGINAL = F.linear
_MARK = "_ds_mem_linear"  # a "_ds_" attribute: a deepcopy of the parameter drops it


def _autocast_on() -> bool:
    return any(torch.is_autocast_enabled(kind) for kind in ("cpu", "cuda"))


def _rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a matrix of its last dimension (``reshape(-1, n)`` cannot
    infer the rows of a tensor with no elements)."""
    return t.reshape(math.prod(t.shape[:-1]), t.shape[-1])


class _Zero3Linear(torch.autograd.Function):
    """``F.linear`` (torch's own, :data:`_ORIGINAL`) that saves ``x``, the
    weight parameter itself and the bias for backward instead of
    ``weight.t()``, with the gradient formulas of autograd's ``AddmmBackward``."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor,
                bias: Optional[torch.Tensor]) -> torch.Tensor:
        ctx.save_for_backward(x, weight, bias)
        return _ORIGINAL(x, weight, bias)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Optional[torch.Tensor], ...]:
        x, weight, bias = ctx.saved_tensors
        grad_x = grad_weight = grad_bias = None
        if ctx.needs_input_grad[0]:
            grad_x = grad.matmul(weight)
        flat = _rows(grad)
        if ctx.needs_input_grad[1]:
            grad_weight = flat.t().mm(_rows(x))
        if bias is not None and ctx.needs_input_grad[2]:
            grad_bias = flat.sum(0)
        return grad_x, grad_weight, grad_bias


def zero3_linear(input: torch.Tensor, weight: torch.Tensor,
                 bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``F.linear`` that does not pin a released stage-3 weight (module docstring)."""
    if not getattr(weight, _MARK, False) or not torch.is_grad_enabled() or _autocast_on():
        saved = _swap.saved
        if saved is _ORIGINAL or saved is None or _calling.depth:
            return _ORIGINAL(input, weight, bias)
        # the replaced F.linear may call this one (a wrapper made while the swap
        # stood, then installed under a later one): it gets torch's, no recursion
        _calling.depth += 1
        try:
            return saved(input, weight, bias)
        finally:
            _calling.depth -= 1
    return _Zero3Linear.apply(input, weight, bias)


class _Calling(threading.local):
    depth = 0  # inside the replaced F.linear, in this thread


_calling = _Calling()


def mark(params: Iterable[torch.Tensor], on: bool) -> None:
    """Make :func:`zero3_linear` take (``on``) or leave the weights ``params``."""
    for p in params:
        if on:
            setattr(p, _MARK, True)
        elif hasattr(p, _MARK):
            delattr(p, _MARK)


class Holder:
    """One holder of the swap (:func:`install`); :func:`uninstall` it once -
    again is harmless."""

    __slots__ = ()


class _Swap:
    """The process-wide swap: who holds it, and the ``F.linear`` it replaced."""

    def __init__(self) -> None:
        self.holders: set[Holder] = set()
        self.saved: Optional[Callable[..., torch.Tensor]] = None  # None: not installed


_swap = _Swap()


def install() -> Holder:
    """One more holder of the swap; the first makes ``F.linear`` :func:`zero3_linear`."""
    if not _swap.holders:
        _swap.saved = _ORIGINAL if F.linear is zero3_linear else F.linear
        F.linear = zero3_linear
    holder = Holder()
    _swap.holders.add(holder)
    return holder


def uninstall(holder: Holder) -> None:
    """``holder`` lets go (a second time does nothing); the last one gives
    ``F.linear`` back what it replaced, unless something else has replaced
    it since."""
    if holder not in _swap.holders:
        return
    _swap.holders.remove(holder)
    if not _swap.holders:
        if F.linear is zero3_linear:
            F.linear = _swap.saved
        _swap.saved = None


def holders() -> int:
    """How many holders the swap has now (0: ``F.linear`` is not dsrun's)."""
    return len(_swap.holders)
