"""The training dataloader ``initialize(training_data=...)`` returns.

As DeepSpeed's ``DeepSpeedDataLoader``: batches of the micro-batch size, each
data-parallel rank reading its own shard through a ``DistributedSampler``
(shuffled, seed 0; a dataset that does not divide evenly is padded by
repeating samples, as the sampler does), ``collate_fn`` honoured, the last
incomplete batch dropped when ``dataloader_drop_last`` is set. Unlike a bare
DataLoader it reshuffles every epoch: each ``iter()`` starts a new epoch.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Callable, Optional

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler


class DsrunDataLoader:
    """Iterate it once per epoch (``for batch in loader``); ``len()`` is the
    number of micro-batches per epoch on this rank."""

    def __init__(self, dataset: Dataset, batch_size: int, *, num_replicas: int, rank: int,
                 collate_fn: Optional[Callable[[list[Any]], Any]] = None,
                 drop_last: bool = False, pin_memory: bool = False, seed: int = 0) -> None:
        self.dataset = dataset
        self.batch_size = batch_size
        self.sampler = DistributedSampler(dataset, num_replicas=num_replicas, rank=rank,
                                          shuffle=True, seed=seed)
        self.loader = DataLoader(dataset, batch_size=batch_size, sampler=self.sampler,
                                 collate_fn=collate_fn, drop_last=drop_last,
                                 pin_memory=pin_memory)
        self.epoch = 0

    def __iter__(self) -> Iterator[Any]:
        self.sampler.set_epoch(self.epoch)
        self.epoch += 1
        return iter(self.loader)

    def __len__(self) -> int:
        return len(self.loader)


def build_dataloader(training_data: Any, *, micro_batch_size: int, num_replicas: int, rank: int,
                     collate_fn: Optional[Callable[[list[Any]], Any]], drop_last: bool,
                     device: torch.device) -> Any:
    """A :class:`DsrunDataLoader` over a Dataset; a DataLoader passes through as is."""
    if isinstance(training_data, DataLoader):
        return training_data
    return DsrunDataLoader(training_data, micro_batch_size, num_replicas=num_replicas,
                           rank=rank, collate_fn=collate_fn, drop_last=drop_last,
                           pin_memory=device.type == "cuda")
