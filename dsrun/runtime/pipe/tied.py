"""Tied weights across pipeline stages: one value under one name.

A :class:`~dsrun.runtime.pipe.layers.TiedLayerSpec` key used by layers on
several stages gives each of those stages its own copy of the tied module.
Per replica, the ranks of those stages form the key's **tied group**; its
first rank (the lowest stage) is the key's **primary** owner.

* At start :meth:`TiedWeights.broadcast` copies the primary's parameters to
  the other owners (after the data-parallel broadcast: all equal rank 0's).
* Every step :meth:`TiedWeights.reduce_grads` sums each tied parameter's
  gradient over the group - what autograd computes when one module is used
  twice in one process. A parameter no owner produced a gradient for keeps
  ``grad = None`` (a presence count travels in the same all-reduce), so an
  optimizer skips it exactly as it would without the pipeline.
* Owners then apply the same update to the same values, so the copies stay
  bitwise equal; the gradient norm counts them once (only the primary's
  copy: :meth:`TiedWeights.duplicates` lists the others).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from dsrun import comm as collectives
from dsrun.runtime.grad_sync import broadcast_tensors


class TiedEntry(NamedTuple):
    key: str
    module: torch.nn.Module
    group: Any  # None: this stage is the key's only owner
    primary: bool
    ranks: tuple[int, ...]  # the owners in this replica, lowest stage first
    weight_attr: tuple[str, ...]  # the TiedLayerSpec's tied_weight_attr


class TiedWeights:
    """The tied modules of this rank and their groups (module docstring)."""

    def __init__(self, entries: list[TiedEntry]) -> None:
        self.held = list(entries)  # every tied module of this rank
        self.entries = [e for e in entries if e.group is not None]  # those shared

    def __bool__(self) -> bool:
        return bool(self.entries)

    def broadcast(self) -> None:
        for entry in self.entries:
            tensors = [*entry.module.parameters(), *entry.module.buffers()]
            if tensors:
                broadcast_tensors(tensors, group=entry.group, src=0)

    @torch.no_grad()
    def reduce_grads(self) -> None:
        for entry in self.entries:
            params = [p for p in entry.module.parameters() if p.requires_grad]
            if not params:
                continue
            sample = params[0]
            parts = [p.grad.reshape(-1) if p.grad is not None else
                     torch.zeros(p.numel(), dtype=p.dtype, device=p.device) for p in params]
            present = torch.tensor([float(p.grad is not None) for p in params],
                                   dtype=sample.dtype, device=sample.device)
            flat = torch.cat([*parts, present])
            collectives.all_reduce(flat, group=entry.group)
            owners_with_grad = flat[flat.numel() - len(params):].tolist()
            offset = 0
            for param, count in zip(params, owners_with_grad):
                n = param.numel()
                if count > 0:
                    summed = flat[offset:offset + n].view_as(param)
                    if param.grad is None:
                        param.grad = summed.clone()
                    else:
                        param.grad.copy_(summed)
                offset += n

    def duplicates(self) -> set[int]:
        """``id`` of the parameters whose copy is not the primary one."""
        return {id(p) for e in self.entries if not e.primary for p in e.module.parameters()}
