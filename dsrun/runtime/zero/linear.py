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

It only takes over for partitioned (``ds_id``) weights outside autocast;
everything else goes to the original. :class:`patched_linear` installs it
as ``torch.nn.functional.linear`` for the duration of a forward pass (the
root module's forward hooks do that), restoring what was there after, and
for an activation checkpoint's recomputation of a module in backward (its
forward hooks do that): the recomputation must save the tensors the
original forward saved.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F

_ORIGINAL = F.linear


def _autocast_on() -> bool:
    return any(torch.is_autocast_enabled(kind) for kind in ("cpu", "cuda"))


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
        flat = grad.reshape(-1, grad.shape[-1])
        if ctx.needs_input_grad[1]:
            grad_weight = flat.t().mm(x.reshape(-1, x.shape[-1]))
        if bias is not None and ctx.needs_input_grad[2]:
            grad_bias = flat.sum(0)
        return grad_x, grad_weight, grad_bias


def zero3_linear(input: torch.Tensor, weight: torch.Tensor,
                 bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``F.linear`` that does not pin a released stage-3 weight (module docstring)."""
    if not hasattr(weight, "ds_id") or not torch.is_grad_enabled() or _autocast_on():
        return _ORIGINAL(input, weight, bias)
    return _Zero3Linear.apply(input, weight, bias)


class patched_linear:
    """``torch.nn.functional.linear`` is :func:`zero3_linear` between
    :meth:`install` and :meth:`restore` (nesting-safe)."""

    def __init__(self) -> None:
        self._saved: Optional[Any] = None

    def install(self) -> None:
        if self._saved is None and F.linear is not zero3_linear:
            self._saved = F.linear
            F.linear = zero3_linear

    def restore(self) -> None:
        if self._saved is not None:
            F.linear = self._saved
            self._saved = None
