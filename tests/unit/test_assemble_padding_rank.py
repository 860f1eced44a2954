"""``dsrun.utils.tensor_fragment._assemble`` when a rank's share of a small
parameter group is padding alone: that rank holds none of the parameter's
elements and may have no gradient for its empty share, which is not a
difference between the ranks' optimizer states. Three ranks are threads
here, their all-reduce a barrier and a sum."""

from __future__ import annotations

import threading
from typing import Any, Optional

import pytest
import torch

from dsrun.errors import DsrunError
from dsrun.runtime.zero.param_state import Part
from dsrun.utils.tensor_fragment import _assemble


class ThreeRanks:
    """An all-reduce (sum) over three threads."""

    def __init__(self) -> None:
        self.barrier = threading.Barrier(3)
        self.sent: list[torch.Tensor] = []
        self.lock = threading.Lock()

    def all_reduce(self, tensor: torch.Tensor) -> None:
        with self.lock:
            self.sent.append(tensor.clone())
        self.barrier.wait()
        tensor.copy_(torch.stack(self.sent).sum(0))


class FakeState:
    """The parts of a ZeRO ParamState that ``_assemble`` reads."""

    sharded = True
    world_size = 3
    device = torch.device("cpu")

    def __init__(self, ranks: ThreeRanks, start: int, end: int) -> None:
        self.ranks, self.start, self.end = ranks, start, end
        self.shape = torch.Size([2])
        self.numel = 2

    def holds_elements(self) -> bool:
        return self.end > self.start

    def all_reduce(self, tensor: torch.Tensor, what: str) -> None:
        self.ranks.all_reduce(tensor)


def assemble(parts: list[Optional[Part]], spans: list[tuple[int, int]]) -> list[Any]:
    ranks, results = ThreeRanks(), [None] * 3

    def run(rank: int) -> None:
        try:
            results[rank] = _assemble(FakeState(ranks, *spans[rank]), parts[rank], "grad")
        except DsrunError as error:
            results[rank] = error

    threads = [threading.Thread(target=run, args=(r,)) for r in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    return results


SPANS = [(0, 1), (1, 2), (2, 2)]  # 2 elements at 3 ranks: rank 2 holds padding alone


def test_a_rank_holding_only_padding_and_no_gradient_is_not_a_difference():
    parts = [Part(0, 1, torch.tensor([3.0])), Part(1, 2, torch.tensor([4.0])), None]
    for result in assemble(parts, SPANS):
        assert torch.equal(result, torch.tensor([3.0, 4.0]))


def test_a_holding_rank_without_the_value_is_still_a_difference():
    parts = [Part(0, 1, torch.tensor([3.0])), None, None]
    for result in assemble(parts, SPANS):
        assert isinstance(result, DsrunError) and "only 1 of the 2" in str(result)


def test_no_rank_with_the_value_is_none():
    assert assemble([None, None, None], SPANS) == [None, None, None]


@pytest.mark.parametrize("empty", [None, Part(2, 2, torch.empty(0))])
def test_the_padding_rank_may_answer_an_empty_part_or_none(empty):
    parts = [Part(0, 1, torch.tensor([1.0])), Part(1, 2, torch.tensor([2.0])), empty]
    for result in assemble(parts, SPANS):
        assert torch.equal(result, torch.tensor([1.0, 2.0]))
