"""What a checkpoint saves besides tensors: the ``checkpoint`` config
section, the test pause point, RNG states, the dataloader position and the
loss scaler (no processes)."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch

from dsrun.errors import DsrunConfigError
from dsrun.runtime.checkpoint.rank_state import capture_rng, restore_loader, restore_rng
from dsrun.runtime.checkpoint.settings import CheckpointSettings, PausePoint
from dsrun.runtime.config import resolve
from dsrun.runtime.dataloader import DsrunDataLoader
from dsrun.runtime.loss_scaler import LossScaler


def config(section: object) -> object:
    return resolve({"train_batch_size": 2, "checkpoint": section}, dp_size=1, dp_source="test")


def test_checkpoint_section_is_strict_and_documented_keys_pass() -> None:
    c = config({"async": True, "timeout": 30, "tag_validation": "Fail", "fsync": False,
                "load_universal": True, "use_node_local_storage": False,
                "parallel_write": {"pipeline_stage": True}})
    assert c.checkpoint.async_save and c.checkpoint.timeout == 30.0
    assert c.to_dict()["checkpoint"]["async"] is True
    settings = CheckpointSettings.from_config(c.checkpoint, environ={})
    assert settings == CheckpointSettings(async_save=True, timeout_s=30.0, fsync=False)
    assert not config({}).checkpoint.async_save
    with pytest.raises(DsrunConfigError, match='unknown key "asynk" in "checkpoint".*"async"'):
        config({"asynk": True})
    with pytest.raises(DsrunConfigError, match="checkpoint.async.*true or false"):
        config({"async": "yes"})


def test_pause_point_from_the_environment() -> None:
    assert PausePoint.from_env({}) is None
    point = PausePoint.from_env({"DSRUN_CHECKPOINT_TEST_PAUSE": "1:commit"})
    assert point == PausePoint(1, "commit")
    point.reached(0, "commit", "t")  # another rank: returns at once
    tagged = PausePoint.from_env({"DSRUN_CHECKPOINT_TEST_PAUSE": "0:write:good"})
    assert tagged.tag == "good"
    tagged.reached(0, "write", "other")  # another tag: returns at once
    for bad in ("x:write", "1", "1:never"):
        with pytest.raises(DsrunConfigError, match="DSRUN_CHECKPOINT_TEST_PAUSE"):
            PausePoint.from_env({"DSRUN_CHECKPOINT_TEST_PAUSE": bad})


def test_rng_states_round_trip_through_json() -> None:
    state = json.loads(json.dumps(capture_rng()))
    expected = (random.random(), float(np.random.rand()), torch.rand(2))
    restore_rng(state)
    got = (random.random(), float(np.random.rand()), torch.rand(2))
    assert got[:2] == expected[:2] and torch.equal(got[2], expected[2])


def loader(replicas: int = 1, rank: int = 0, size: int = 4) -> DsrunDataLoader:
    data = torch.utils.data.TensorDataset(torch.arange(24.0))
    return DsrunDataLoader(data, size, num_replicas=replicas, rank=rank)


def batches(it: object, n: int) -> list[list[float]]:
    return [next(it)[0].tolist() for _ in range(n)]  # type: ignore[call-overload]


def test_dataloader_position_resumes_with_the_next_batch() -> None:
    straight = loader()
    it = iter(straight)
    batches(it, 2)
    state = straight.state_dict()
    assert state == {"epoch": 0, "batch": 2, "batch_size": 4, "shuffle_epoch": 0,
                     "num_replicas": 1, "dataset_len": 24, "total_size": 24,
                     "drop_last": False, "shuffle": True, "seed": 0}
    rest = batches(it, 4) + batches(iter(straight), 2)
    resumed = loader()
    resumed.load_state_dict(state)
    assert resumed.state_dict() == state
    again = iter(resumed)
    assert batches(again, 4) + batches(iter(resumed), 2) == rest


def test_a_finished_epoch_resumes_with_the_next_one() -> None:
    straight = loader()
    assert len(list(straight)) == 6
    state = straight.state_dict()
    assert (state["epoch"], state["batch"]) == (1, 0)
    resumed = loader()
    resumed.load_state_dict(state)
    assert [b[0].tolist() for b in resumed] == [b[0].tolist() for b in straight]


def epochs_seen(loader_: DsrunDataLoader, start: int, stop: int, save_at: int = -1
                ) -> tuple[list[list[float]], dict]:
    """A script's loop: ``for epoch in range(start, stop): for batch in
    loader``, saving the position after its ``save_at``-th batch and
    stopping there (a crash right after a checkpoint)."""
    seen: list[list[float]] = []
    for _ in range(start, stop):
        for batch in loader_:
            seen.append(batch[0].tolist())
            if len(seen) == save_at:
                return seen, loader_.state_dict()
    return seen, {}


@pytest.mark.parametrize("save_at", [5, 6, 12])  # mid-epoch, an epoch's last batch (twice)
def test_a_save_on_an_epochs_last_batch_resumes_that_epochs_end(save_at: int) -> None:
    """Saved inside the loop on its last batch, the epoch is not over yet:
    the resumed script, restarting the same epoch of its own counter, must
    see its loop end at once and then the next epochs - not an extra one."""
    everything, _ = epochs_seen(loader(), 0, 3)
    first, state = epochs_seen(loader(), 0, 3, save_at=save_at)
    epoch = (save_at - 1) // 6  # the script's epoch when it saved (its client_state)
    if save_at % 6 == 0:
        assert state["batch"] == 6 and state["epoch"] == epoch
    resumed = loader()
    resumed.load_state_dict(state)
    rest, _ = epochs_seen(resumed, epoch, 3)
    assert first + rest == everything


def test_epochs_repeat_one_order_unless_the_script_sets_the_epoch() -> None:
    """DeepSpeed's loader never calls set_epoch itself: every epoch has the
    same shuffled order until ``data_sampler.set_epoch`` changes it; that
    shuffle epoch is part of the position."""
    plain = loader()
    first, second = [[b[0].tolist() for b in plain] for _ in range(2)]
    assert first == second and first != sorted(first)
    plain.data_sampler.set_epoch(1)
    third = [b[0].tolist() for b in plain]
    assert third != first
    plain.data_sampler.set_epoch(5)
    it = iter(plain)
    batches(it, 2)
    state = plain.state_dict()
    assert state["shuffle_epoch"] == 5 and state["epoch"] == 3
    resumed = loader()
    resumed.load_state_dict(state)
    assert batches(iter(resumed), 4) == batches(it, 4)
    # a position saved when every epoch reshuffled keeps its epoch's order
    old = loader()
    old.load_state_dict({"epoch": 2, "batch": 0, "batch_size": 4})
    assert old.data_sampler.epoch == 2


def test_a_position_saved_at_another_world_size_counts_samples() -> None:
    two = loader(replicas=2, size=2)
    it = iter(two)
    batches(it, 3)  # 3 batches x 2 samples x 2 ranks = 12 samples of the epoch
    saved = {"state": two.state_dict(), "dp_world": 2}
    one = loader(replicas=1, size=4)
    restore_loader(one, saved, dp_world=1)
    assert one.state_dict()["batch"] == 3  # 12 samples / (4 x 1)


def test_loss_scaler_state_round_trips() -> None:
    scaler = LossScaler(scale=2.0**10, window=2, hysteresis=2)
    for overflow in (True, True, False, False, False):
        scaler.update(overflow)
    other = LossScaler(scale=2.0**10, window=2, hysteresis=2)
    other.load_state_dict(scaler.state_dict())
    assert other.state_dict() == scaler.state_dict()
    for overflow in (True, False, False):
        assert other.update(overflow) == scaler.update(overflow)
        assert other.scale == scaler.scale


def test_an_iterator_made_before_the_load_starts_at_the_loaded_position() -> None:
    """``RepeatingLoader(loader)`` (which calls ``iter()``) right after
    ``initialize``, then ``load_checkpoint``: the data continues where the
    checkpoint stopped, not at the start of an epoch."""
    from dsrun.runtime.dataloader import RepeatingLoader

    straight = loader()
    it = RepeatingLoader(straight)
    batches(it, 8)  # one epoch of 6, two of the next
    state = straight.state_dict()
    rest = batches(it, 6)
    resumed = loader()
    early = RepeatingLoader(resumed)
    resumed.load_state_dict(state)
    assert batches(early, 6) == rest
