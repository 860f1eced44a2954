"""The ZeRO stage-1 reducer (reduction during backward) over a parameter
first used twice in one backward - a block under two reentrant
checkpoints - in the second backward, after a first without reuse, on a
one-rank gloo group: on CPU summed (both backwards' gradients land, as
plain torch computes them); where the agreement on extra gradients is a
host sync (an accelerator, simulated) refused, naming the parameter, when
the next backward starts (so that every rank refuses it at once).

Before: refused on CPU as well (the ranks stopped agreeing after a first
backward without extra gradients; in a job, on the rank that saw it
alone).
"""

from __future__ import annotations

import pytest
import torch
import torch.utils.checkpoint
from torch import nn

from dsrun.errors import DsrunError
from dsrun.runtime.zero.partition import GroupLayout
from dsrun.runtime.zero.reducer import GradReducer, GradSource


def _setup() -> tuple[nn.Module, nn.Module, GradReducer, torch.Tensor]:
    torch.manual_seed(0)
    blk, head = nn.Linear(4, 4), nn.Linear(4, 1)
    params = [head.weight, head.bias, blk.weight, blk.bias]  # backward order
    layout = GroupLayout(tuple(p.numel() for p in params), world_size=1)
    accumulator = torch.zeros(layout.partition_numel)

    def land(group: int, start: int, values: torch.Tensor) -> None:
        accumulator.narrow(0, start, values.numel()).add_(values)

    import torch.distributed as dist
    reducer = GradReducer([GradSource(p, 0, i) for i, p in enumerate(params)], [layout],
                          rank=0, world_size=1, group=dist.group.WORLD,
                          bucket_numel=1, overlap=False, contiguous=True,
                          dtype=torch.float32, land=land, add_extra=land)
    return blk, head, reducer, accumulator


def _loss(blk: nn.Module, head: nn.Module, x: torch.Tensor, uses: int) -> torch.Tensor:
    h = x.requires_grad_()  # a reentrant checkpoint's input must require grad
    for _ in range(uses):  # each use under its own reentrant checkpoint
        h = torch.utils.checkpoint.checkpoint(blk, h, use_reentrant=True)
    return head(h).sum()


def _expected(x: torch.Tensor) -> torch.Tensor:
    """Plain torch: the summed gradients of both backwards, flat."""
    torch.manual_seed(0)
    blk, head = nn.Linear(4, 4), nn.Linear(4, 1)
    for uses in (1, 2):
        h = x.detach()
        for _ in range(uses):
            h = blk(h)
        head(h).sum().backward()
    return torch.cat([p.grad.reshape(-1) for p in (head.weight, head.bias, blk.weight,
                                                   blk.bias)])


def test_cpu_sums_a_reuse_first_seen_in_a_later_backward(solo: None) -> None:
    blk, head, reducer, accumulator = _setup()
    x = torch.randn(3, 4)
    for uses in (1, 2):
        _loss(blk, head, x, uses).backward()
        reducer.finish()
    torch.testing.assert_close(accumulator, _expected(x), rtol=0, atol=1e-6)
    reducer.close()


def test_refused_where_the_agreement_stops_after_the_first_backward(solo: None) -> None:
    blk, head, reducer, _ = _setup()
    reducer._keep_watching = False  # as on an accelerator
    x = torch.randn(3, 4)
    _loss(blk, head, x, 1).backward()
    reducer.finish()
    _loss(blk, head, x, 2).backward()  # noted, not refused: the other ranks go on too
    reducer.finish()
    with pytest.raises(DsrunError, match=r"parameter 3 of param group 0 \(shape \(4,\)\) "
                                         r"received gradients twice .*in the last backward.* "
                                         r"first backward in which no rank had any"
                                         r".*use_reentrant=False"):
        _loss(blk, head, x, 1).backward()  # refused when the next round starts
    reducer.reset()
    reducer.close()
