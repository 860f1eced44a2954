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
consumed, in ``load_state_dict`` only; one of a dataset of another length is
refused). After ``load_state_dict`` the next ``iter()`` continues that epoch
with the next batch (the sampler skips the indices already used, no sample
is loaded to skip it, and inside an epoch nothing is drawn: the RNG state a
load restores was saved after that epoch's draw; a position saved after an
``iter()`` that drew for an epoch's first batch says so, ``"drawn"``, and
the first ``iter()`` after its load does not draw again); when the epoch had
ended (its iterator raised StopIteration), it starts the next one.

The loader's place is one :class:`LoaderState`: READY (no epoch in
progress; the next iterator starts at ``at``) or RUNNING (the current
iterator - the one started last - is ``at`` in its epoch). A loaded
position stays loaded until the engine trains on a batch after it: the
engine's loaders (``deepspeed_io``, ``initialize(training_data=)``) read the
engine's step counters (``step_clock``), and a new ``iter()`` before they
moved starts at the loaded position again - ``next(iter(loader))`` after a
load, to look at a batch, then the training loop, loses no batch, and a save
in between saves the loaded position; once a step trained a batch, the
position counts it, also when the loop then stops (one step, ``break``,
save). A loader without a ``step_clock`` counts every batch it hands out.
Saved on an epoch's last batch, inside the script's ``for`` loop, the
position is "that epoch, nothing left": the resumed ``for`` loop over the
epoch ends at once, as the uninterrupted one was about to, and the script's
next ``iter()`` starts the next epoch (were it "next epoch", a script that
resumes its own epoch counter from the checkpoint would train one epoch too
many).
"""

from __future__ import annotations

import dataclasses
import enum
import itertools
import logging
import weakref
from collections.abc import Iterator, Mapping
from typing import Any, Callable, NamedTuple, Optional

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler

log = logging.getLogger("dsrun.runtime.dataloader")


class ResumableSampler(DistributedSampler):
    """A DistributedSampler whose next epoch may start ``skip`` indices in."""

    skip = 0

    def __iter__(self) -> Iterator[int]:
        skip, self.skip = self.skip, 0
        return itertools.islice(super().__iter__(), skip, None)


class Position(NamedTuple):
    """``batch`` batches of epoch ``epoch`` handed out (the next is ``batch``)."""

    epoch: int
    batch: int


class Phase(enum.Enum):
    READY = "ready"      # no epoch in progress: the next iterator starts at ``at``
    RUNNING = "running"  # the current iterator has handed out ``at``


@dataclasses.dataclass
class LoaderState:
    """Where a :class:`DsrunDataLoader` is. ``loaded``: the position a load
    put it at, while no training step has used a batch after it (READY: not
    yet iterated; RUNNING: the current iterator started there when the
    engine's step counter read ``mark``). ``drawn`` (READY at a first batch):
    the global RNG state holds that epoch's draw, made by an ``iter()`` or
    - ``predrawn`` - before the save this state was loaded from, in which
    case the next ``iter()`` makes none."""

    phase: Phase
    at: Position
    loaded: Optional[Position] = None
    mark: Any = None
    drawn: bool = False
    predrawn: bool = False


class DsrunDataLoader:
    """Iterate it once per epoch (``for batch in loader``); ``len()`` is the
    number of micro-batches per epoch on this rank."""

    def __init__(self, dataset: Dataset, batch_size: int, *, num_replicas: int, rank: int,
                 collate_fn: Optional[Callable[[list[Any]], Any]] = None,
                 drop_last: bool = False, pin_memory: bool = False, seed: int = 0,
                 tput_timer: Any = None, step_clock: Optional[Callable[[], Any]] = None
                 ) -> None:
        self.dataset = dataset
        # The engine's ThroughputTimer: started before each batch is fetched,
        # so its figure includes data loading (DeepSpeed's loader does this).
        self.tput_timer = tput_timer
        # The engine's step counters (engine_step_clock): a batch is trained
        # on once they change after it was handed out.
        self.step_clock = step_clock
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
        self.state = LoaderState(Phase.READY, Position(0, 0))
        #: the engine took a step between a batch of this loader and the next
        #: request to its iterator: it is a training loader (save warnings)
        self.trained = False
        self._loads = 0         # load_state_dict calls so far: an older iter()'s draw was undone
        self._current: object = None  # the token of the iterator started last

    def __iter__(self) -> Iterator[Any]:
        # torch's DataLoader without a generator (DeepSpeed's) draws its base
        # seed from the global generator at iter(): so does this one, for an
        # epoch that starts at its first batch
        self._undo_look()
        if self._next_start().batch == 0:
            self._take_draw()
            if self.state.phase is Phase.READY:
                self.state.drawn = True
        return self._epoch(self._loads)

    def _clock(self) -> Any:
        return None if self.step_clock is None else self.step_clock()

    def _looking(self) -> Optional[Position]:
        """The loaded position while the current iterator's batches are only
        looked at (no step since it started); a step ends that for good."""
        state = self.state
        if state.phase is not Phase.RUNNING or state.loaded is None:
            return None
        if self._clock() != state.mark:
            state.loaded = None
        return state.loaded

    def _undo_look(self) -> None:
        """A new iterator after batches that were only looked at starts at
        the loaded position again."""
        loaded = self._looking()
        if loaded is not None:
            self.state = LoaderState(Phase.READY, loaded, loaded=loaded)

    def _next_start(self) -> Position:
        state = self.state
        if state.phase is Phase.READY:
            return state.at
        return Position(state.at.epoch + 1, 0)  # an iterator left mid-epoch: the next epoch

    def _take_draw(self) -> None:
        if self.state.predrawn:
            self.state.predrawn = False  # the loaded RNG state holds this draw
        else:
            _draw_seed()

    def _epoch(self, loads: int) -> Iterator[Any]:
        """One epoch, started at its first ``next()`` (a generator runs
        nothing before that): an iterator made before ``load_state_dict``
        - ``RepeatingLoader(loader)`` right after ``initialize``, then
        ``load_checkpoint`` - still starts at the loaded position."""
        token = self._current = object()
        batches = self._start(loads)
        while True:
            batch = self._fetch(batches, token)
            if batch is _END:
                return
            mark = self._clock()
            yield batch
            if mark != self._clock():
                self.trained = True

    def _start(self, loads: int) -> Iterator[Any]:
        """Make the current iterator RUNNING at where the next one starts;
        the DataLoader iterator over the rest of that epoch."""
        self._undo_look()
        start = self._next_start()
        if loads != self._loads and start.batch == 0:
            self._take_draw()  # a load since iter() put the global RNG back before its draw
        loaded = self.state.loaded if self.step_clock is not None else None
        self.state = LoaderState(Phase.RUNNING, start, loaded=loaded, mark=self._clock())
        self.sampler.skip = start.batch * self.batch_size
        return iter(self.loader)

    def _fetch(self, batches: Iterator[Any], token: object) -> Any:
        """The next batch of ``batches`` (counted when ``token`` is the
        current iterator's), or ``_END``."""
        timer = self.tput_timer
        if timer is not None and not timer.started:  # a pipeline's batch started it
            timer.start()
        current = self._current is token
        try:
            batch = next(batches)
        except StopIteration:
            if timer is not None:
                timer.started = False  # no batch came: no interval
            if current:
                self.state = LoaderState(Phase.READY, Position(self.state.at.epoch + 1, 0))
            return _END
        if current:
            self._looking()  # a step since the last batch: they were trained on
            epoch, done = self.state.at
            self.state.at = Position(epoch, done + 1)
        return batch

    def __len__(self) -> int:
        return len(self.loader)

    def state_dict(self) -> dict[str, Any]:
        """The position of the next batch: ``epoch`` and ``batch`` within
        it (:class:`LoaderState`: a RUNNING epoch's batches handed out, the
        loaded position while they are only looked at); ``shuffle_epoch``:
        the sampler's epoch (its order); ``drawn`` (only when true): the
        global RNG state holds the draw of that epoch's first ``iter()``.
        What a load checks (:meth:`state_problem`): ``dataset_len``,
        ``shuffle``, ``seed``; what it converts the position by:
        ``batch_size``, ``num_replicas``. ``total_size`` (the sampler's
        samples of all ranks, padding included) and ``drop_last`` describe
        the epoch for a reader; a load does not read them."""
        looking = self._looking()
        state = self.state
        epoch, batch = looking if looking is not None else state.at
        out = {"epoch": epoch, "batch": batch, "batch_size": self.batch_size,
               "shuffle_epoch": int(self.sampler.epoch), "num_replicas": self.num_replicas,
               "dataset_len": len(self.dataset), "total_size": int(self.sampler.total_size),
               "drop_last": self.drop_last, "shuffle": bool(self.sampler.shuffle),
               "seed": int(self.sampler.seed)}
        if state.phase is Phase.READY and batch == 0 and (state.drawn or state.predrawn):
            out["drawn"] = True
        return out

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
        converted through the samples consumed (:meth:`rescale_state`; a
        state without ``num_replicas`` counts in this loader's). A position
        saved before the shuffle epoch was recorded (when every epoch
        reshuffled) keeps that epoch's order. Raises ValueError for a state
        of other data (:meth:`state_problem`)."""
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
        at = Position(epoch, min(batch, len(self)))
        self.state = LoaderState(Phase.READY, at, loaded=at,
                                 predrawn=batch == 0 and bool(state.get("drawn", False)))
        self._loads += 1

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


def engine_step_clock(engine: Any) -> Callable[[], tuple[int, int]]:
    """A ``step_clock`` for ``engine``'s loaders: its step counters, which
    change whenever it trains a batch (``engine.step()`` counts a micro-step,
    a pipeline's ``train_batch`` a global step). Holds the engine weakly
    (the engine holds its loader)."""
    ref = weakref.ref(engine)

    def clock() -> tuple[int, int]:
        owner = ref()
        return (-1, -1) if owner is None else (int(owner.global_steps), int(owner.micro_steps))

    return clock


#: what DsrunDataLoader._fetch returns when the epoch has no batch left
_END = object()


def _draw_seed() -> None:
    """The global generator's draw of torch's DataLoader without a
    ``generator`` at each ``iter()`` (its workers' base seed)."""
    torch.empty((), dtype=torch.int64).random_()


def build_dataloader(training_data: Any, *, micro_batch_size: int, num_replicas: int, rank: int,
                     collate_fn: Optional[Callable[[list[Any]], Any]], drop_last: bool,
                     device: torch.device, tput_timer: Any = None,
                     step_clock: Optional[Callable[[], Any]] = None) -> Any:
    """A :class:`DsrunDataLoader` over a Dataset; a DataLoader passes through as is."""
    if isinstance(training_data, DataLoader):
        return training_data
    return DsrunDataLoader(training_data, micro_batch_size, num_replicas=num_replicas,
                           rank=rank, collate_fn=collate_fn, drop_last=drop_last,
                           pin_memory=device.type == "cuda", tput_timer=tput_timer,
                           step_clock=step_clock)


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
