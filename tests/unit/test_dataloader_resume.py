"""Resuming the engine dataloader's position (DsrunDataLoader, restore_loader):
another micro-batch size at the same data-parallel size, a position of
another dataset, a look at batches after the load against a loop that
trains one batch and stops (the engine's step counter tells them apart), and
the global RNG draw of torch's DataLoader (DeepSpeed's numbers, bitwise
resume of dropout, also from a save before an epoch's first batch)."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch

from dsrun.runtime.checkpoint.rank_state import (
    capture_rng,
    restore_loader,
    restore_rng,
    unsaved_loaders,
)
from dsrun.runtime.dataloader import DsrunDataLoader, RepeatingLoader


def loader(n: int = 24, size: int = 4, replicas: int = 1, rank: int = 0) -> DsrunDataLoader:
    return DsrunDataLoader(torch.utils.data.TensorDataset(torch.arange(float(n))), size,
                           num_replicas=replicas, rank=rank)


def ids(batches: Any) -> list[float]:
    return [x for b in batches for x in b[0].tolist()]


def take(it: Any, n: int) -> list[float]:
    return ids(next(it) for _ in range(n))


@pytest.mark.parametrize("old, new, steps", [(1, 2, 4), (2, 1, 2), (2, 4, 2), (4, 2, 1)])
def test_another_micro_batch_size_at_the_same_world_size_continues_at_the_next_sample(
        old: int, new: int, steps: int) -> None:
    """2 ranks, micro-batch ``old`` for ``steps`` batches, resumed at micro-batch
    ``new`` (same global batch by gradient accumulation): every rank continues
    with the sample after the last one it consumed."""
    for rank in (0, 1):
        straight = loader(n=16, size=old, replicas=2, rank=rank)
        it = iter(straight)
        take(it, steps)
        saved = {"state": straight.state_dict(), "dp_world": 2}
        rest = ids(it)
        resumed = loader(n=16, size=new, replicas=2, rank=rank)
        restore_loader(resumed, saved, dp_world=2)
        assert ids(resumed) == rest
        # the loader's own load_state_dict converts too (no restore_loader)
        direct = loader(n=16, size=new, replicas=2, rank=rank)
        direct.load_state_dict(saved["state"])
        assert ids(direct) == rest


def test_a_position_that_is_not_whole_new_batches_is_warned(
        caplog: pytest.LogCaptureFixture) -> None:
    straight = loader(n=12, size=3)
    take(iter(straight), 1)
    resumed = loader(n=12, size=2)
    with caplog.at_level(logging.WARNING, logger="dsrun.runtime.dataloader"):
        resumed.load_state_dict(straight.state_dict())
    assert "3 samples into epoch 0) is not a whole number of batches of 2" in caplog.text
    assert resumed.state_dict()["batch"] == 1


def test_a_position_of_another_dataset_is_not_restored(caplog: pytest.LogCaptureFixture
                                                       ) -> None:
    """A fine-tuning load on a new dataset (another length) starts at its
    first batch, with one warning saying why; load_state_dict refuses it."""
    old = loader(n=12, size=1)
    take(iter(old), 3)
    saved = {"state": old.state_dict(), "dp_world": 1}
    new = loader(n=20, size=1)
    with caplog.at_level(logging.INFO, logger="dsrun.runtime.checkpoint"):
        assert restore_loader(new, saved, dp_world=1, announce=True) is None
    assert "not restored: it was saved with dataset_len=12, this dataloader has 20" \
        in caplog.text
    assert len(caplog.records) == 1
    assert len(ids(new)) == 20  # the whole first epoch
    with pytest.raises(ValueError, match="dataset_len=12, this dataloader has 20"):
        loader(n=20, size=1).load_state_dict(saved["state"])


def test_a_restored_position_is_announced_with_the_opt_out(caplog: pytest.LogCaptureFixture
                                                           ) -> None:
    old = loader()
    take(iter(old), 2)
    new = loader()
    with caplog.at_level(logging.INFO, logger="dsrun.runtime.checkpoint"):
        restore_loader(new, {"state": old.state_dict(), "dp_world": 1}, 1, announce=True)
    assert "continues at epoch 0, batch 2 of 6" in caplog.text
    assert '"checkpoint": {"load_data_position": false}' in caplog.text
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="dsrun.runtime.checkpoint"):
        restore_loader(loader(), {"state": old.state_dict(), "dp_world": 1}, 1)
    assert caplog.text == ""  # other ranks say nothing


class Steps:
    """An engine's step counter, as the engine's loaders read it (``step_clock``)."""

    def __init__(self) -> None:
        self.count = 0

    def __call__(self) -> int:
        return self.count

    def step(self) -> None:
        self.count += 1


def engine_loader(steps: Steps, n: int = 24, size: int = 4) -> DsrunDataLoader:
    return DsrunDataLoader(torch.utils.data.TensorDataset(torch.arange(float(n))), size,
                           num_replicas=1, rank=0, step_clock=steps)


def saved_at(batches: int) -> tuple[dict, list[float]]:
    """A position ``batches`` into the first epoch, and the rest of that epoch."""
    straight = loader()
    it = iter(straight)
    take(it, batches)
    return straight.state_dict(), ids(it)


def test_a_look_at_batches_after_the_load_keeps_the_loaded_position() -> None:
    """``next(iter(loader))`` after the load (an example batch, shapes): the
    training loop after it still starts at the loaded position; a save in
    between saves the loaded position."""
    state, rest = saved_at(2)
    steps = Steps()
    resumed = engine_loader(steps)
    resumed.load_state_dict(state)
    assert ids([next(iter(resumed))]) == rest[:4]
    assert resumed.state_dict() == state
    kept = iter(resumed)
    assert take(kept, 2) == rest[:8]  # a look at two batches, its iterator still alive
    assert resumed.state_dict() == state
    trained = []
    for batch in resumed:
        trained += ids([batch])
        steps.step()
    assert trained == rest


def test_one_trained_batch_after_the_load_moves_the_position() -> None:
    """A resumed loop that trains one batch and stops (its step budget,
    ``break``): a save then is one batch on, and a resume from it goes on
    with the batch after - none is trained twice."""
    state, rest = saved_at(2)
    steps = Steps()
    resumed = engine_loader(steps)
    resumed.load_state_dict(state)
    for batch in resumed:
        assert ids([batch]) == rest[:4]
        steps.step()
        break
    moved = resumed.state_dict()
    assert (moved["epoch"], moved["batch"]) == (0, 3)
    again = engine_loader(Steps())
    again.load_state_dict(moved)
    assert ids(again) == rest[4:]
    # once a step trained a batch, a new iter() is a new epoch, as in a run never stopped
    assert ids(iter(resumed)) == ids(loader())


def test_without_a_step_clock_every_batch_handed_out_counts() -> None:
    state, rest = saved_at(2)
    resumed = loader()
    resumed.load_state_dict(state)
    assert ids([next(iter(resumed))]) == rest[:4]
    assert resumed.state_dict()["batch"] == 3


def test_only_a_loader_the_engine_stepped_between_batches_of_is_trained() -> None:
    steps = Steps()
    evaluation, training = engine_loader(steps), engine_loader(steps)
    assert len(ids(evaluation)) == 24
    it = iter(training)
    next(it)
    steps.step()
    assert len(ids(evaluation)) == 24 and not evaluation.trained
    next(it)
    assert training.trained


def test_an_epoch_starting_at_its_first_batch_draws_from_the_global_generator() -> None:
    """As torch's DataLoader without a generator (DeepSpeed's): one draw at
    each iter() - so dropout after it gets DeepSpeed's masks."""
    data = torch.utils.data.TensorDataset(torch.arange(8.0))
    sampler = torch.utils.data.DistributedSampler(data, num_replicas=1, rank=0)
    torch.manual_seed(3)
    iter(torch.utils.data.DataLoader(data, batch_size=2, sampler=sampler))
    expected = torch.get_rng_state()
    mine = DsrunDataLoader(data, 2, num_replicas=1, rank=0)
    torch.manual_seed(3)
    iter(mine)
    assert torch.equal(torch.get_rng_state(), expected)


def run(loader_: DsrunDataLoader, epochs: int, stop: int = -1, it: Any = None
        ) -> tuple[list[Any], Any]:
    """A script's loop with dropout: ``for epoch: for batch in loader``,
    returning (epoch, batch ids, dropout mask) per step; stops after step
    ``stop`` with the state a save would keep (position and RNG)."""
    drop = torch.nn.Dropout(0.5)
    seen: list[Any] = []
    for _ in range(epochs):
        for batch in (loader_ if it is None else it):
            seen.append((batch[0].tolist(), drop(torch.ones(8)).tolist()))
            if len(seen) == stop:
                return seen, (loader_.state_dict(), capture_rng())
        it = None
    return seen, None


@pytest.mark.parametrize("stop", [2, 6, 8])  # mid-epoch, an epoch's last batch, next epoch
def test_dropout_resumes_bitwise(stop: int) -> None:
    torch.manual_seed(0)
    everything, _ = run(loader(), 3)
    torch.manual_seed(0)
    first, (position, rng) = run(loader(), 3, stop=stop)
    epoch = position["epoch"]
    torch.manual_seed(1)  # a new process
    resumed = loader()
    early = RepeatingLoader(resumed)  # an iterator made before the load (it drew)
    resumed.load_state_dict(position)
    restore_rng(rng)
    rest, _ = run(resumed, 3 - epoch)
    assert first + rest == everything
    torch.manual_seed(1)
    again = loader()
    early = RepeatingLoader(again)
    again.load_state_dict(position)
    restore_rng(rng)
    drop = torch.nn.Dropout(0.5)
    steps = [(next(early)[0].tolist(), drop(torch.ones(8)).tolist()) for _ in rest]
    assert first + steps == everything


def test_dropout_resumes_bitwise_from_a_save_after_the_epoch_ended() -> None:
    """Saved after the loop's end: the next epoch starts at its first batch
    and draws, also from an iterator made before the load (its draw at
    iter() was undone by the load's RNG state)."""
    torch.manual_seed(0)
    everything, _ = run(loader(), 2)
    torch.manual_seed(0)
    straight = loader()
    first, _ = run(straight, 1)
    position, rng = straight.state_dict(), capture_rng()
    assert (position["epoch"], position["batch"]) == (1, 0)
    torch.manual_seed(1)
    resumed = loader()
    early = RepeatingLoader(resumed)
    resumed.load_state_dict(position)
    restore_rng(rng)
    drop = torch.nn.Dropout(0.5)
    steps = [(next(early)[0].tolist(), drop(torch.ones(8)).tolist()) for _ in range(6)]
    assert first + steps == everything


@pytest.mark.parametrize("early", [True, False])
def test_dropout_resumes_bitwise_from_a_save_before_the_first_batch(early: bool) -> None:
    """``RepeatingLoader(loader)`` right after ``initialize`` (its iter()
    drew), then a checkpoint before the first batch: the resumed run makes no
    second draw, whether its RepeatingLoader is made before the load
    (``early``) or after it."""
    torch.manual_seed(0)
    straight = loader()
    it = RepeatingLoader(straight)
    position, rng = straight.state_dict(), capture_rng()
    assert position["drawn"] is True and (position["epoch"], position["batch"]) == (0, 0)
    drop = torch.nn.Dropout(0.5)
    everything = [(next(it)[0].tolist(), drop(torch.ones(8)).tolist()) for _ in range(9)]
    torch.manual_seed(1)  # a new process
    resumed = loader()
    it = RepeatingLoader(resumed) if early else None
    resumed.load_state_dict(position)
    restore_rng(rng)
    it = it or RepeatingLoader(resumed)
    steps = [(next(it)[0].tolist(), drop(torch.ones(8)).tolist()) for _ in range(9)]
    assert steps == everything
    assert "drawn" not in resumed.state_dict()  # it is RUNNING, mid-epoch


def test_loaders_whose_position_is_not_saved_are_named() -> None:
    plain = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.arange(4.0)))
    steps = Steps()
    engine_loader_ = engine_loader(steps)
    other, evaluation = engine_loader(steps), engine_loader(steps)
    assert unsaved_loaders(engine_loader_, [engine_loader_]) == []
    [warning] = unsaved_loaders(plain, [])
    assert "DataLoader given to initialize(training_data=) as it is" in warning
    ids(evaluation)  # a pass without steps: an evaluation loader
    assert unsaved_loaders(engine_loader_, [engine_loader_, other, evaluation]) == []
    it = iter(other)
    next(it)
    steps.step()
    next(it)
    [warning] = unsaved_loaders(engine_loader_, [engine_loader_, other, evaluation])
    assert "DsrunDataLoader built by engine.deepspeed_io() is not " \
        "engine.training_dataloader" in warning
    assert unsaved_loaders(None, []) == []
    # a torch DataLoader (deepspeed_io with a data_sampler or workers) is
    # named whether or not it was trained from: it cannot tell
    [warning] = unsaved_loaders(engine_loader_, [engine_loader_, plain])
    assert "DataLoader built by engine.deepspeed_io(route='train') with a data_sampler" \
        in warning and "if the engine trains from it" in warning
    assert unsaved_loaders(plain, [plain]) == [unsaved_loaders(plain, [])[0]]
