"""The training dataloader ``initialize(training_data=...)`` returns.

As DeepSpeed's ``DeepSpeedDataLoader``: batches of the micro-batch size, each
data-parallel rank reading its own shard through a ``DistributedSampler``
(shuffled, seed 0; a dataset that does not divide evenly is padded by
repeating samples, as the sampler does), ``collate_fn`` honoured, the last
incomplete batch dropped when ``dataloader_drop_last`` is set. As in
DeepSpeed, every epoch comes in the same shuffled order unless the script
reshuffles with ``loader.data_sampler.set_epoch(epoch)`` (the sampler's
shuffle epoch is the script's; dsrun counts epochs only for the data
position). A pipeline engine's loader shuffles too (DeepSpeed's pipeline
loader reads in order), so the same data order - and a checkpoint's data
position - holds whether a model trains as a pipeline or not.

:class:`RepeatingLoader` (DeepSpeed's ``deepspeed.utils.RepeatingLoader``)
is an endless iterator over any loader, restarting it when it runs out.

Its position is checkpointed (``state_dict``/``load_state_dict``, which
``engine.save_checkpoint``/``load_checkpoint`` call): the epoch, how many
batches of it were handed out, and the sampler's shuffle epoch. After ``load_state_dict`` the next
``iter()`` continues that epoch with the next batch (the sampler skips the
indices already used, no sample is loaded to skip it); when the epoch had
ended (its iterator raised StopIteration), it starts the next one. Saved
on an epoch's last batch, inside the script's ``for`` loop, the position
is "that epoch, nothing left": the resumed ``for`` loop over the epoch
ends at once, as the uninterrupted one was about to, and the script's next
``iter()`` starts the next epoch (were it "next epoch", a script that
resumes its own epoch counter from the checkpoint would train one epoch
too many).
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterator, Mapping
from typing import Any, Callable, Optional

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler

log = logging.getLogger("dsrun.runtime.dataloader")


class ResumableSampler(DistributedSampler):
    """A DistributedSampler whose next epoch may start ``skip`` indices in."""

    skip = 0

    def __iter__(self) -> Iterator[int]:
        skip, self.skip = self.skip, 0
        return itertools.islice(super().__iter__(), skip, None)


class DsrunDataLoader:
    """Iterate it once per epoch (``for batch in loader``); ``len()`` is the
    number of micro-batches per epoch on this rank."""

    def __init__(self, dataset: Dataset, batch_size: int, *, num_replicas: int, rank: int,
                 collate_fn: Optional[Callable[[list[Any]], Any]] = None,
                 drop_last: bool = False, pin_memory: bool = False, seed: int = 0,
                 tput_timer: Any = None) -> None:
        self.dataset = dataset
        # The engine's ThroughputTimer: started before each batch is fetched,
        # so its figure includes data loading (DeepSpeed's loader does this).
        self.tput_timer = tput_timer
        self.batch_size = batch_size
        self.sampler = ResumableSampler(dataset, num_replicas=num_replicas, rank=rank,
                                        shuffle=True, seed=seed)
        # Its own generator: a DataLoader draws a seed at every iter(), which
        # from the global generator would shift dropout after a resume.
        self.loader = DataLoader(dataset, batch_size=batch_size, sampler=self.sampler,
                                 collate_fn=collate_fn, drop_last=drop_last,
                                 pin_memory=pin_memory,
                                 generator=torch.Generator().manual_seed(seed))
        self.data_sampler = self.sampler  # DeepSpeed's name for it
        self.num_replicas = num_replicas
        self.epoch = 0          # the epoch the next iter() starts
        self.batches = 0        # batches handed out of the epoch in progress
        self._resume_at = 0     # batches the next iter() skips
        self._started = False   # an iter() since construction or load_state_dict
        self._ended = False     # the epoch in progress raised StopIteration

    def __iter__(self) -> Iterator[Any]:
        return self._epoch()

    def _epoch(self) -> Iterator[Any]:
        """One epoch, started at its first ``next()`` (a generator runs
        nothing before that): an iterator made before ``load_state_dict``
        - ``RepeatingLoader(loader)`` right after ``initialize``, then
        ``load_checkpoint`` - still starts at the loaded position."""
        self.sampler.skip = self._resume_at * self.batch_size
        self.batches, self._resume_at = self._resume_at, 0
        self.epoch += 1
        self._started, self._ended = True, False
        batches = iter(self.loader)
        while True:
            timer = self.tput_timer
            if timer is not None and not timer.started:  # a pipeline's batch started it
                timer.start()
            try:
                batch = next(batches)
            except StopIteration:
                if timer is not None:
                    timer.started = False  # no batch came: no interval
                self._ended = True
                return
            self.batches += 1
            yield batch

    def __len__(self) -> int:
        return len(self.loader)

    def state_dict(self) -> dict[str, int]:
        """The position of the next batch: ``epoch`` and ``batch`` within
        it; ``shuffle_epoch``: the sampler's epoch (its order)."""
        order = {"batch_size": self.batch_size, "shuffle_epoch": int(self.sampler.epoch)}
        if not self._started:
            return {"epoch": self.epoch, "batch": self._resume_at, **order}
        current = self.epoch - 1
        if self._ended:
            return {"epoch": current + 1, "batch": 0, **order}
        return {"epoch": current, "batch": self.batches, **order}

    def load_state_dict(self, state: Mapping[str, int]) -> None:
        """Continue at ``state``'s position with the next ``iter()``. A
        position saved before the shuffle epoch was recorded (when every
        epoch reshuffled) keeps that epoch's order."""
        epoch, batch = int(state["epoch"]), int(state["batch"])
        self.sampler.set_epoch(int(state.get("shuffle_epoch", epoch)))
        # batch == len: the epoch's batches were all handed out but its loop
        # had not ended (module docstring); more (a position rescaled from
        # another world size) means the same
        batch = min(batch, len(self))
        self.epoch, self._resume_at, self.batches = epoch, batch, 0
        self._started = False

    def rescale_state(self, state: Mapping[str, int], saved_replicas: int,
                      replicas: int) -> dict[str, int]:
        """A position saved with ``saved_replicas`` data-parallel ranks, for
        ``replicas`` ranks: the same number of samples consumed in the epoch."""
        consumed = int(state["batch"]) * int(state.get("batch_size", self.batch_size)) \
            * saved_replicas
        per_batch = self.batch_size * replicas
        if consumed % per_batch:
            log.warning("the dataloader position (%d samples into epoch %d) is not a whole "
                        "number of batches at %d ranks: resuming at the batch before it",
                        consumed, state["epoch"], replicas)
        return {"epoch": int(state["epoch"]), "batch": consumed // per_batch,
                "batch_size": self.batch_size,
                "shuffle_epoch": int(state.get("shuffle_epoch", state["epoch"]))}


def build_dataloader(training_data: Any, *, micro_batch_size: int, num_replicas: int, rank: int,
                     collate_fn: Optional[Callable[[list[Any]], Any]], drop_last: bool,
                     device: torch.device, tput_timer: Any = None) -> Any:
    """A :class:`DsrunDataLoader` over a Dataset; a DataLoader passes through as is."""
    if isinstance(training_data, DataLoader):
        return training_data
    return DsrunDataLoader(training_data, micro_batch_size, num_replicas=num_replicas,
                           rank=rank, collate_fn=collate_fn, drop_last=drop_last,
                           pin_memory=device.type == "cuda", tput_timer=tput_timer)


class RepeatingLoader:
    """``loader``'s batches without end: when it runs out, ``iter(loader)``
    again (a new epoch for a :class:`DsrunDataLoader`). An iterator, so
    ``engine.train_batch(data_iter=RepeatingLoader(loader))`` keeps reading
    where the last call stopped."""

    def __init__(self, loader: Any) -> None:
        self.loader = loader
        self.data_iter = iter(loader)

    def __iter__(self) -> RepeatingLoader:
        return self

    def __next__(self) -> Any:
        try:
            return next(self.data_iter)
        except StopIteration:
            self.data_iter = iter(self.loader)
            try:
                return next(self.data_iter)
            except StopIteration:
                raise RuntimeError(f"RepeatingLoader: the {type(self.loader).__name__} "
                                   "yields no batches") from None


#: DeepSpeed's name (``from deepspeed.runtime.dataloader import DeepSpeedDataLoader``).
DeepSpeedDataLoader = DsrunDataLoader
