"""``loss.backward()`` called by the script instead of ``engine.backward(loss)``.

``engine.backward`` divides the loss by ``gradient_accumulation_steps``,
multiplies it by the fp16 loss scale and, at ZeRO stage 0, all-reduces the
gradients while backward runs. A backward the script starts itself does
none of this: the ranks' stage-0 weights drift apart, accumulated updates
are ``gradient_accumulation_steps`` times too large, and fp16 updates are
divided by a scale the loss never had - all silently. DeepSpeed refuses a
direct backward at stage 0 and scales it with output hooks at stages 1-3
(its "torch-style backward", with ``engine.scale(loss)`` for fp16).

dsrun notices a direct backward with a hook on each tensor the engine's
forward returns (it only records; gradients pass unchanged) and
``engine.step()`` refuses to apply a micro-step whose gradients came only
from one, where the result would be wrong: at stage 0 with more than one
data-parallel rank, with gradient accumulation, and under a loss scale. At
ZeRO 1-3 without accumulation or scaling a direct backward gives the same
gradients as ``engine.backward`` (their reduction runs from gradient hooks),
and is left alone. A backward of the engine's output inside
``engine.backward`` (or ``torch.autograd.grad`` next to it, e.g. a gradient
penalty) is not a direct one.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from dsrun.errors import DsrunError
from dsrun.runtime.zero.fetch import output_tensors


class DirectBackward:
    """Records, per micro-step, whether gradients came through
    ``engine.backward`` and whether a direct backward reached the outputs."""

    def __init__(self) -> None:
        self._inside = 0  # engine.backward calls running
        self.engine_backward = False
        self.direct = False

    def watch(self, output: Any) -> None:
        """Hook the engine forward's output tensors that will get gradients."""
        if not torch.is_grad_enabled():
            return
        for tensor in output_tensors(output):
            if tensor.requires_grad:
                tensor.register_hook(self._on_grad)

    def _on_grad(self, grad: torch.Tensor) -> None:
        if not self._inside:
            self.direct = True

    @contextlib.contextmanager
    def engine_backward_running(self) -> Iterator[None]:
        self._inside += 1
        try:
            yield
        finally:
            self._inside -= 1
        self.engine_backward = True

    def check_step(self, *, zero_stage: int, dp_world_size: int, accumulation: int,
                   scaled: bool) -> None:
        """At ``engine.step()``: the error for a micro-step whose gradients
        only a direct backward made, where they are wrong; then start afresh."""
        direct_only = self.direct and not self.engine_backward
        self.direct = self.engine_backward = False
        if not direct_only:
            return
        why = []
        if zero_stage == 0 and dp_world_size > 1:
            why.append("at ZeRO stage 0 only engine.backward all-reduces the gradients "
                       "(DeepSpeed refuses a direct backward there too)")
        if accumulation > 1:
            why.append(f"it divides the loss by gradient_accumulation_steps ({accumulation})")
        if scaled:
            why.append("it multiplies the loss by the loss scale the step divides by")
        if why:
            raise DsrunError(
                "engine.step() after loss.backward() was called directly: use "
                "engine.backward(loss) - " + "; ".join(why) + ". The step was not applied "
                "(dsrun has no engine.scale(loss) for DeepSpeed's torch-style backward)")
