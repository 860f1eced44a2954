"""A training batch's losses as every rank of a pipeline sees them.

The last stage computes the loss of each micro-batch, and after each
forward pass there asks the module for DeepSpeed's additional losses
(``PipelineModule.get_additional_losses()``: a mapping of names to
single-element tensors, or ``None``), summing each name over the batch
(:func:`add_additional`). At the optimizer step, :class:`LossAggregator`
averages both over the micro-batches and the data-parallel replicas and
sends them to every stage, as DeepSpeed 0.19.8's pipeline engine does:
``train_batch()`` returns the loss and ``engine.get_additional_losses()``
(= ``engine.agg_additional_losses``) is the same float32 mapping on every
rank.

Where DeepSpeed asks each stage's own module for the names (and fails when
a stage's hook answers differently), the names here are the last stage's
only: the stages agree on them once, with one extra object broadcast when
they change; each batch then costs the one all-reduce and one broadcast
the loss already needs, one float longer. The last stages of all replicas
must report the same names.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from typing import Any, Optional

import torch

from dsrun import comm as collectives
from dsrun.errors import DsrunError


def add_additional(totals: Optional[OrderedDict[str, torch.Tensor]], values: Any,
                   where: str) -> Optional[OrderedDict[str, torch.Tensor]]:
    """``totals`` with one micro-batch's additional losses ``values`` (the
    hook's answer) added, name by name (a name first seen now starts at its
    value, as in DeepSpeed); ``None`` while the hook has answered ``None``."""
    if values is None:
        return totals
    if not isinstance(values, Mapping):
        raise DsrunError(f"{where}: get_additional_losses() returned a "
                         f"{type(values).__name__}; it must return a mapping of names to "
                         "single-element tensors, or None")
    totals = OrderedDict() if totals is None else totals
    for name, value in values.items():
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            value = torch.tensor(float(value))
        if not isinstance(value, torch.Tensor) or value.numel() != 1:
            what = f"a tensor of shape {list(value.shape)}" if isinstance(value, torch.Tensor) \
                else f"a {type(value).__name__}"
            raise DsrunError(f"{where}: get_additional_losses()[{name!r}] is {what}; each "
                             "additional loss must be a single-element tensor")
        value = value.detach().float().reshape(())
        totals[name] = value.clone() if name not in totals else totals[name] + value.to(
            totals[name].device)
    return totals


def _means(totals: Optional[OrderedDict[str, torch.Tensor]], names: tuple[str, ...],
           count: int, device: torch.device) -> torch.Tensor:
    """The summed additional losses ``names`` divided by the micro-batches."""
    assert totals is not None
    return torch.stack([totals[name] for name in names]).to(device) / count


class LossAggregator:
    """The batch's loss and additional losses on every rank (module
    docstring); ``names`` are the additional losses' names the stages last
    agreed on (``None``: the hook answered ``None``)."""

    def __init__(self, grid: Any, dp_group: Any, dp_world_size: int,
                 device: torch.device) -> None:
        self.grid = grid
        self.dp_group = dp_group
        self.dp_world_size = dp_world_size
        self.device = device
        self.names: Optional[tuple[str, ...]] = None
        self._src = grid.stage_to_global(grid.stages - 1)

    def reduce(self, losses: Optional[list[torch.Tensor]],
               totals: Optional[OrderedDict[str, torch.Tensor]], count: int
               ) -> tuple[torch.Tensor, Optional[OrderedDict[str, torch.Tensor]]]:
        """The mean loss and the mean additional losses of a batch of
        ``count`` micro-batches, on every rank; ``losses`` and ``totals``
        (the per-micro-batch losses, the summed additional ones) are the
        last stage's, ignored elsewhere."""
        last = self.grid.is_last_stage
        names = (None if totals is None else tuple(totals)) if last else None
        known = self.names or ()
        payload = torch.zeros(count + 1 + len(known), dtype=torch.float32, device=self.device)
        if last:
            assert losses is not None
            payload[:count] = torch.stack(losses).to(self.device)
            if names != self.names:
                payload[count] = 1.0  # the names changed: agreed on below
            elif known:
                payload[count + 1:] = _means(totals, known, count, self.device)
        self._share(payload)
        if payload[count] > 0:
            values = self._agree_on(names, totals, count)
        else:
            values = payload[count + 1:]
        extra = None if self.names is None else OrderedDict(
            (name, values[i].clone()) for i, name in enumerate(self.names))
        return payload[:count].mean(), extra

    def _share(self, payload: torch.Tensor) -> None:
        """Average ``payload`` over the last stage's replicas, then send it
        down each pipeline."""
        if self.grid.is_last_stage and self.dp_world_size > 1:
            collectives.all_reduce(payload, group=self.dp_group)
            payload /= self.dp_world_size
        if self.grid.stages > 1:
            collectives.broadcast(payload, src=self._src, group=self.grid.pipe_group)

    def _agree_on(self, names: Optional[tuple[str, ...]],
                  totals: Optional[OrderedDict[str, torch.Tensor]], count: int) -> torch.Tensor:
        """Every stage takes the last stage's new ``names``; their averaged values."""
        if self.grid.stages > 1:
            box = [names]
            collectives.broadcast_object_list(box, src=self._src, group=self.grid.pipe_group,
                                              device=self.device)
            names = box[0]
        self.names = names
        values = torch.zeros(len(names or ()), dtype=torch.float32, device=self.device)
        if self.grid.is_last_stage and names:
            values[:] = _means(totals, names, count, self.device)
        if names:
            self._share(values)
        return values
