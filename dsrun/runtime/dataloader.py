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

As torch's ``DataLoader`` without a ``generator`` (DeepSpeed's), each
``iter()`` that starts an epoch at its first batch draws once from torch's
global generator, so dropout after it gets DeepSpeed's masks; batches are
loaded in the training process (DeepSpeed's loader uses 2 worker processes
per rank).

Its position is checkpointed (``state_dict``/``load_state_dict``, which
``engine.save_checkpoint``/``load_checkpoint`` call): the epoch, how many
batches of it were handed out, and the sampler's shuffle epoch, with the
batch size, replicas and dataset length it counts in (a position saved at
another batch size or number of replicas is converted through the samples
consumed; one of a dataset of another length is refused). After ``load_state_dict`` the next
``iter()`` continues that epoch with the next batch (the sampler skips the
indices already used, no sample is loaded to skip it, and inside an epoch nothing is drawn:
the RNG state a load restores was saved after that epoch's draw); when the epoch had
ended (its iterator raised StopIteration), it starts the next one. The
loaded position stays until the iterator that resumed it is asked for its
second batch: ``next(iter(loader))`` after a load, then the training loop,
still starts the loop at the loaded position. Saved
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
        self.drop_last = drop_last
        self.sampler = ResumableSampler(dataset, num_replicas=num_replicas, rank=rank,
                                        shuffle=True, seed=seed)
        # A private generator for the DataLoader's own draw at iter(): the
        # global generator's draw is made by _draw_seed, only when an epoch
        # starts at its first batch (a resumed epoch's draw was made before
        # the save, whose RNG state the load restores).
        self.loader = DataLoader(dataset, batch_size=batch_size, sampler=self.sampler,
                                 collate_fn=collate_fn, drop_last=drop_last,
                                 pin_memory=pin_memory,
                                 generator=torch.Generator().manual_seed(seed))
        self.data_sampler = self.sampler  # DeepSpeed's name for it
        self.num_replicas = num_replicas
        self.epoch = 0          # the epoch the next iter() starts
        self.batches = 0        # batches handed out of the epoch in progress
        # (epoch, batch) of a loaded position no iterator has gone past yet
        self._loaded: Optional[tuple[int, int]] = None
        self._loads = 0         # load_state_dict calls so far
        self._current: object = None  # the token of the iterator started last
        self._started = False   # an iter() since construction or load_state_dict
        self._ended = False     # the epoch in progress raised StopIteration

    def __iter__(self) -> Iterator[Any]:
        # torch's DataLoader without a generator (DeepSpeed's) draws its base
        # seed from the global generator at iter(): so does this one, for an
        # epoch that starts at its first batch
        drew = self._next_start() == 0
        if drew:
            _draw_seed()
        return self._epoch(drew, self._loads)

    def _next_start(self) -> int:
        return 0 if self._loaded is None else self._loaded[1]

    def _epoch(self, drew: bool, loads: int) -> Iterator[Any]:
        """One epoch, started at its first ``next()`` (a generator runs
        nothing before that): an iterator made before ``load_state_dict``
        - ``RepeatingLoader(loader)`` right after ``initialize``, then
        ``load_checkpoint`` - still starts at the loaded position. An
        iterator that starts at a loaded position keeps it loaded until it
        is asked for its second batch (or the epoch ends): a new ``iter()``
        before that - ``next(iter(loader))`` to look at a batch, then the
        training loop - starts at the loaded position again."""
        resumed = self._loaded
        epoch, start = resumed if resumed is not None else (self.epoch, 0)
        if start == 0 and (not drew or loads != self._loads):
            _draw_seed()  # a load since iter() put the global RNG back before its draw
        token = self._current = object()
        self.sampler.skip = start * self.batch_size
        self.epoch, self.batches = epoch + 1, start
        self._started, self._ended = True, False
        batches = iter(self.loader)
        while True:
            batch = self._fetch(batches)
            if batch is _END:
                if resumed is not None and self._current is token:
                    self._loaded = None
                return
            try:
                yield batch
            except GeneratorExit:
                if resumed is not None and self._current is token:
                    self._started = False  # dropped after one batch: the loaded position stands
                raise
            if resumed is not None and self._current is token:
                self._loaded = None  # its first batch was used: the position moved on
            resumed = None

    def _fetch(self, batches: Iterator[Any]) -> Any:
        """The next batch of ``batches`` (counted), or ``_END``."""
        timer = self.tput_timer
        if timer is not None and not timer.started:  # a pipeline's batch started it
            timer.start()
        try:
            batch = next(batches)
        except StopIteration:
            if timer is not None:
                timer.started = False  # no batch came: no interval
            self._ended = True
            return _END
        self.batches += 1
        return batch

    def __len__(self) -> int:
        return len(self.loader)

    def state_dict(self) -> dict[str, Any]:
        """The position of the next batch: ``epoch`` and ``batch`` within
        it; ``shuffle_epoch``: the sampler's epoch (its order); and what a
        load checks or converts the position by: ``batch_size``,
        ``num_replicas``, ``dataset_len``, ``total_size`` (the sampler's
        samples of all ranks, padding included), ``drop_last``, ``shuffle``,
        ``seed``."""
        layout = {"batch_size": self.batch_size, "shuffle_epoch": int(self.sampler.epoch),
                  "num_replicas": self.num_replicas, "dataset_len": len(self.dataset),
                  "total_size": int(self.sampler.total_size), "drop_last": self.drop_last,
                  "shuffle": bool(self.sampler.shuffle), "seed": int(self.sampler.seed)}
        if not self._started:
            epoch, batch = self._loaded if self._loaded is not None else (self.epoch, 0)
        elif self._ended:
            epoch, batch = self.epoch, 0
        else:
            epoch, batch = self.epoch - 1, self.batches
        return {"epoch": epoch, "batch": batch, **layout}

    def state_problem(self, state: Mapping[str, Any]) -> Optional[str]:
        """Why ``state`` is not a position in this loader's data (another
        dataset length or order), or None. States saved before these were
        recorded pass."""
        mine = {"dataset_len": len(self.dataset), "shuffle": bool(self.sampler.shuffle),
                "seed": int(self.sampler.seed)}
        for key, value in mine.items():
            if key in state and state[key] != value:
                return f"it was saved with {key}={state[key]!r}, this dataloader has {value!r}"
        return None

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue at ``state``'s position with the next ``iter()``; a
        position saved at another micro-batch size or number of replicas is
        converted through the samples consumed (:meth:`rescale_state`). A
        position saved before the shuffle epoch was recorded (when every
        epoch reshuffled) keeps that epoch's order. Raises ValueError for a
        state of other data (:meth:`state_problem`)."""
        problem = self.state_problem(state)
        if problem is not None:
            raise ValueError(f"DsrunDataLoader.load_state_dict: not a position in this data: "
                             f"{problem}")
        replicas = int(state.get("num_replicas", self.num_replicas))
        if replicas != self.num_replicas or \
                int(state.get("batch_size", self.batch_size)) != self.batch_size:
            state = self.rescale_state(state, replicas, self.num_replicas)
        epoch, batch = int(state["epoch"]), int(state["batch"])
        self.sampler.set_epoch(int(state.get("shuffle_epoch", epoch)))
        # batch == len: the epoch's batches were all handed out but its loop
        # had not ended (module docstring); more (a position rescaled from
        # another world size) means the same
        self._loaded = (epoch, min(batch, len(self)))
        self.epoch, self.batches, self._loads = epoch, 0, self._loads + 1
        self._started = False

    def rescale_state(self, state: Mapping[str, Any], saved_replicas: int,
                      replicas: int) -> dict[str, Any]:
        """A position saved with ``saved_replicas`` data-parallel ranks (and
        its ``batch_size``), for ``replicas`` ranks of this loader's batch
        size: the same number of samples consumed in the epoch."""
        consumed = int(state["batch"]) * int(state.get("batch_size", self.batch_size)) \
            * saved_replicas
        per_batch = self.batch_size * replicas
        if consumed % per_batch:
            log.warning("the dataloader position (%d samples into epoch %d) is not a whole "
                        "number of batches of %d samples (%d ranks x %d): resuming at the "
                        "batch before it", consumed, state["epoch"], per_batch, replicas,
                        self.batch_size)
        return {**state, "epoch": int(state["epoch"]), "batch": consumed // per_batch,
                "batch_size": self.batch_size, "num_replicas": replicas,
                "shuffle_epoch": int(state.get("shuffle_epoch", state["epoch"]))}


#: what DsrunDataLoader._fetch returns when the epoch has no batch left
_END = object()


def _draw_seed() -> None:
    """The global generator's draw of torch's DataLoader without a
    ``generator`` at each ``iter()`` (its workers' base seed)."""
    torch.empty((), dtype=torch.int64).random_()


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
