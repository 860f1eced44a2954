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
partitioned parameters of a stage-3 model with ``memory_efficient_linear``
on), with grad enabled and outside autocast; everything else goes to the
original. That decision depends on the call alone, so an activation
checkpoint's recomputation takes the same path as the original forward and
saves the same tensors - torch's non-reentrant checkpoint requires it, and
the recomputation may run outside every hooked module (a checkpointed
function calling ``F.linear(h, self.head.weight)``).

**When it is installed.** ``torch.nn.functional.linear`` is
:func:`zero3_linear` from the first :func:`install` until the matching last
:func:`uninstall` (a stage-3 model's fetcher holds it from its creation to
its ``close()``), as DeepSpeed installs its own for the rest of the
process. A swap installed only around the root module's forward would not
cover a recomputation in backward.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any, Optional

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
        return _ORIGINAL(input, weight, bias)
    return _Zero3Linear.apply(input, weight, bias)


def mark(params: Iterable[torch.Tensor], on: bool) -> None:
    """Make :func:`zero3_linear` take (``on``) or leave the weights ``params``."""
    for p in params:
        if on:
            setattr(p, _MARK, True)
        elif hasattr(p, _MARK):
            delattr(p, _MARK)


_swap: dict[str, Any] = {"holders": 0, "saved": None}


def install() -> None:
    """One more holder of the swap; the first makes ``F.linear`` :func:`zero3_linear`."""
    if _swap["holders"] == 0:
        _swap["saved"] = _ORIGINAL if F.linear is zero3_linear else F.linear
        F.linear = zero3_linear
    _swap["holders"] += 1


def uninstall() -> None:
    """One holder fewer; the last gives ``F.linear`` back what it replaced,
    unless something else has replaced it since."""
    if _swap["holders"] == 0:
        return
    _swap["holders"] -= 1
    if _swap["holders"] == 0 and F.linear is zero3_linear:
        F.linear = _swap["saved"]
