"""A Megatron-style ``mpu`` with model-parallel size > 1: the rule of which
parameters a rank counts in the step's norm (:mod:`dsrun.runtime.norms`),
and what ``initialize()`` links and says at once (the 4-rank behaviour is
tests/dist/test_tp_norms.py)."""

from __future__ import annotations

import logging
import math
from typing import Any

import pytest
import torch
import torch.distributed as dist

import dsrun
from dsrun.runtime.norms import model_parallel_of, split_squares


class FakeMpu:
    """One rank that claims a model-parallel group of ``size`` (its
    collectives run over the one-rank world)."""

    def __init__(self, size: int, tp_rank: int = 0) -> None:
        self.size, self.tp_rank = size, tp_rank

    def get_model_parallel_group(self) -> Any:
        return dist.group.WORLD

    def get_model_parallel_world_size(self) -> int:
        return self.size

    def get_model_parallel_rank(self) -> int:
        return self.tp_rank

    def get_data_parallel_group(self) -> Any:
        return dist.group.WORLD

    def get_data_parallel_world_size(self) -> int:
        return 1

    def get_data_parallel_rank(self) -> int:
        return 0


def test_model_parallel_only_above_size_one() -> None:
    assert model_parallel_of(None) is None
    assert model_parallel_of(object()) is None  # no get_model_parallel_world_size
    assert model_parallel_of(FakeMpu(1)) is None


def test_replicated_parameters_count_on_tensor_parallel_rank_zero_only() -> None:
    split, replicated = torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(2))
    split.tensor_model_parallel = True  # type: ignore[attr-defined]
    first, second = model_parallel_of(FakeMpu(2, 0)), model_parallel_of(FakeMpu(2, 1))
    assert first is not None and second is not None
    assert first.counts(split) and first.counts(replicated)
    assert second.counts(split) and not second.counts(replicated)


def test_split_squares_counts_one_side_and_sees_the_other_sides_infs() -> None:
    counted = [torch.tensor([3.0, 4.0]), torch.sparse_coo_tensor([[0, 0]], [1.0, 1.0], (3,),
                                                                check_invariants=True)]
    finite = split_squares(counted, [torch.tensor([100.0])], torch.device("cpu"))
    assert float(finite) == pytest.approx(25.0 + 4.0)  # the sparse one by its coalesced value 2
    for bad in (math.inf, math.nan):
        total = split_squares(counted, [torch.tensor([1.0, bad])], torch.device("cpu"))
        assert math.isinf(float(total))


def test_initialize_links_the_group_and_says_what_is_not_done(
        solo: None, caplog: pytest.LogCaptureFixture) -> None:
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 1.0,
              "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
              "zero_allow_untested_optimizer": True}
    for stage in (0, 1):
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            engine, _, _, _ = dsrun.initialize(
                model=torch.nn.Linear(3, 1), mpu=FakeMpu(2),
                config={**config, "zero_optimization": {"stage": stage}})
        linked = engine.precision if stage == 0 else engine.optimizer
        assert linked.model_parallel is not None and linked.model_parallel.size == 2
        assert "model-parallel size 2 from the mpu" in caplog.text
        assert "not implemented for model parallelism" in caplog.text
        engine.backward(engine(torch.ones(2, 3)).sum())
        engine.step()
        assert engine.was_step_applied()
        engine.destroy()
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        engine, _, _, _ = dsrun.initialize(model=torch.nn.Linear(3, 1), mpu=FakeMpu(1),
                                           config=config)
    assert engine.precision.model_parallel is None
    assert "model-parallel size" not in caplog.text
    engine.destroy()
