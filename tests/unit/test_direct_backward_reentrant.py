"""Which passes through an engine output run a reentrant checkpoint
(:func:`dsrun.runtime.direct_backward.reaches_reentrant_checkpoint`, asked
from the output's gradient hook, as the engine asks it): a pass that does
is a training backward even when no parameter is in its own graph.

The output produced by the checkpoint itself (the loss computed inside
it) was not seen: torch never counts the running pass's root among the
nodes it will execute, so ``loss.backward()`` was neither divided by the
accumulation steps nor all-reduced. ``torch.autograd.grad`` taken with
respect to such an output captures its gradient without running the
checkpoint, and was taken for a training backward.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.utils.checkpoint

from dsrun.runtime.direct_backward import reaches_reentrant_checkpoint


def _answer(output: torch.Tensor, run: Callable[[], Any]) -> list[bool]:
    """What the check answers in ``output``'s gradient hook during ``run()``."""
    seen: list[bool] = []
    root = output.grad_fn

    def hook(grad: torch.Tensor) -> torch.Tensor:
        seen.append(reaches_reentrant_checkpoint(root))
        return grad

    output.register_hook(hook)
    run()
    return seen


def _loss_in_checkpoint() -> torch.Tensor:
    torch.manual_seed(0)
    layer = torch.nn.Linear(3, 1)
    x = torch.randn(2, 3, requires_grad=True)
    return torch.utils.checkpoint.checkpoint(lambda t: layer(t).square().mean(), x,
                                             use_reentrant=True)


def test_backward_of_the_checkpoints_own_output_runs_it() -> None:
    loss = _loss_in_checkpoint()
    assert _answer(loss, loss.backward) == [True]


def test_grad_with_respect_to_the_checkpoints_output_does_not_run_it() -> None:
    out = _loss_in_checkpoint()
    penalty = out * 3
    assert _answer(out, lambda: torch.autograd.grad(penalty, out)) == [False]

