"""The engine dataloader's position through ``save_checkpoint`` /
``load_checkpoint`` on a one-rank engine in this process: the
``checkpoint.load_data_position`` opt-out (scripts that skip to their own
position), the line a load logs, and the warnings a save gives for training
loaders whose position it does not keep."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch

import dsrun
from dsrun.errors import DsrunConfigError
from dsrun.runtime.dataloader import RepeatingLoader

pytestmark = pytest.mark.dist

DATA = torch.utils.data.TensorDataset(torch.arange(8.0))


def build(checkpoint: dict | None = None, training_data: Any = DATA,
          model: torch.nn.Module | None = None) -> Any:
    torch.manual_seed(0)
    config: dict = {"train_micro_batch_size_per_gpu": 1,
                    "optimizer": {"type": "SGD", "params": {"lr": 0.0}}}
    if checkpoint is not None:
        config["checkpoint"] = checkpoint
    engine, _, _, _ = dsrun.initialize(model=model or torch.nn.Linear(1, 1), config=config,
                                       training_data=training_data)
    return engine


def train(engine: Any, loader: Any, steps: int) -> list[float]:
    seen = []
    for (x,) in loader:
        engine.backward(engine(x.unsqueeze(-1)).sum())
        engine.step()
        seen.append(x.item())
        if len(seen) == steps:
            break
    return seen


def test_the_position_is_restored_and_announced_unless_opted_out(
        solo: None, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The DeepSpeed idiom - a step counter in client_state, then skipping
    that many batches - gives the straight run's data with the opt-out."""
    straight = build()
    order = train(straight, straight.training_dataloader, 8)
    first = build()
    assert train(first, first.training_dataloader, 3) == order[:3]
    first.save_checkpoint(str(tmp_path), client_state={"step": 3})
    resumed = build()
    with caplog.at_level(logging.INFO, logger="dsrun.runtime.checkpoint"):
        resumed.load_checkpoint(str(tmp_path))
    assert "continues at epoch 0, batch 3 of 8" in caplog.text
    assert train(resumed, resumed.training_dataloader, 5) == order[3:]
    own = build({"load_data_position": False})
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="dsrun.runtime.checkpoint"):
        _, client = own.load_checkpoint(str(tmp_path))
    assert "not restored (checkpoint.load_data_position is false)" in caplog.text
    skipped = [x.item() for i, (x,) in enumerate(own.training_dataloader)
               if i >= client["step"]]
    assert skipped == order[3:]
    with pytest.raises(DsrunConfigError, match="checkpoint.load_data_position"):
        build({"load_data_position": "no"})


def test_a_save_names_training_loaders_whose_position_it_does_not_keep(
        solo: None, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    ready = build(training_data=torch.utils.data.DataLoader(DATA))
    with caplog.at_level(logging.WARNING, logger="dsrun.runtime.checkpoint"):
        ready.save_checkpoint(str(tmp_path / "a"))
        ready.save_checkpoint(str(tmp_path / "a"))
    assert caplog.text.count("its data position is not saved") == 1  # once per engine
    assert "DataLoader given to initialize(training_data=) as it is" in caplog.text
    caplog.clear()
    engine = build(training_data=None)
    loader = engine.deepspeed_io(DATA)
    evaluation = engine.deepspeed_io(DATA)  # DeepSpeed's default route, used to evaluate
    routed = engine.deepspeed_io(DATA, route="eval")
    with caplog.at_level(logging.WARNING, logger="dsrun.runtime.checkpoint"):
        assert len(list(evaluation)) == len(list(routed)) == 8
        engine.save_checkpoint(str(tmp_path / "b"))  # nothing trained from yet
    assert "not saved" not in caplog.text
    with caplog.at_level(logging.WARNING, logger="dsrun.runtime.checkpoint"):
        train(engine, loader, 2)
        assert len(list(evaluation)) == 8
        engine.save_checkpoint(str(tmp_path / "b"))
    assert caplog.text.count("its data position is not saved") == 1
    assert "DsrunDataLoader built by engine.deepspeed_io() is not" in caplog.text
    assert loader.trained and not evaluation.trained
    caplog.clear()
    engine = build(training_data=None)
    engine.training_dataloader = engine.deepspeed_io(DATA)  # the README's way to have it saved
    with caplog.at_level(logging.WARNING, logger="dsrun.runtime.checkpoint"):
        train(engine, engine.training_dataloader, 2)
        engine.save_checkpoint(str(tmp_path / "c"))
        build().save_checkpoint(str(tmp_path / "d"))  # initialize(training_data=Dataset)
    assert "not saved" not in caplog.text
    engine = build(training_data=None)
    sampled = engine.deepspeed_io(DATA, data_sampler=torch.utils.data.SequentialSampler(DATA))
    with caplog.at_level(logging.WARNING, logger="dsrun.runtime.checkpoint"):
        train(engine, sampled, 2)
        engine.save_checkpoint(str(tmp_path / "e"))
        engine.save_checkpoint(str(tmp_path / "e"))
    assert caplog.text.count("saves no position for it; if the engine trains from it") == 1


def test_a_resumed_loop_of_one_step_moves_the_position_and_a_look_does_not(
        solo: None, tmp_path: Path) -> None:
    """Resumed, one step (``max_steps`` one away), ``break``, save, resume
    again: no sample is trained twice. A ``next(iter(loader))`` after a load,
    then the loop, loses none, and a save between them keeps the position."""
    straight = build()
    order = train(straight, straight.training_dataloader, 8)
    first = build()
    train(first, first.training_dataloader, 3)
    first.save_checkpoint(str(tmp_path), tag="a")
    second = build()
    second.load_checkpoint(str(tmp_path), tag="a")
    assert train(second, second.training_dataloader, 1) == order[3:4]
    second.save_checkpoint(str(tmp_path), tag="b")
    third = build()
    third.load_checkpoint(str(tmp_path), tag="b")
    loader = third.training_dataloader
    assert next(iter(loader))[0].item() == order[4]  # a look
    third.save_checkpoint(str(tmp_path), tag="c")
    assert train(third, loader, 4) == order[4:]
    fourth = build()
    fourth.load_checkpoint(str(tmp_path), tag="c")
    assert train(fourth, fourth.training_dataloader, 4) == order[4:]


def test_a_save_before_the_first_batch_resumes_dropout_bitwise(
        solo: None, tmp_path: Path) -> None:
    """``RepeatingLoader(engine.training_dataloader)`` right after
    ``initialize``, a checkpoint before the first batch: the resumed run's
    losses (dropout) are the straight run's, bit for bit."""
    def model() -> torch.nn.Module:
        return torch.nn.Sequential(torch.nn.Linear(1, 16), torch.nn.Dropout(0.5),
                                   torch.nn.Linear(16, 1))

    def losses(engine: Any, it: Any, steps: int) -> list[float]:
        out = []
        for _ in range(steps):
            (x,) = next(it)
            loss = engine(x.unsqueeze(-1)).sum()
            engine.backward(loss)
            engine.step()
            out.append(loss.item())
        return out

    straight = build(model=model())
    it = RepeatingLoader(straight.training_dataloader)
    straight.save_checkpoint(str(tmp_path))
    expected = losses(straight, it, 10)
    resumed = build(model=model())
    it = RepeatingLoader(resumed.training_dataloader)
    torch.rand(5)  # the new process's RNG differs until the load
    resumed.load_checkpoint(str(tmp_path))
    assert losses(resumed, it, 10) == expected
