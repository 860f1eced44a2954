"""The arithmetic of DeepSpeed's set_train_batch_size /
set_train_micro_batch_size (dsrun.runtime.batch_size.new_batch), pure."""

from __future__ import annotations

import pytest

from dsrun.runtime.batch_size import new_batch


@pytest.mark.parametrize(("current", "dp", "kwargs", "expected"), [
    ((16, 2, 2), 4, {"train": 64}, (64, 2, 8)),
    ((16, 2, 2), 4, {"train": 8}, (8, 2, 1)),
    ((16, 2, 2), 4, {"micro": 3}, (24, 3, 2)),
    ((6, 3, 1), 2, {"micro": 1}, (2, 1, 1)),
    ((4, 4, 1), 1, {"train": 4}, (4, 4, 1)),
    ((16, 2, 2), 4, {"train": 32.0}, (32, 2, 4)),  # a whole float, as the config takes it
])
def test_new_batch(current: tuple, dp: int, kwargs: dict, expected: tuple) -> None:
    train, micro, accum = new_batch(current, dp, **kwargs)
    assert (train, micro, accum) == expected
    assert train == micro * accum * dp


@pytest.mark.parametrize(("kwargs", "fragment"), [
    ({"train": 12}, "train_batch_size 12 is not a multiple of micro-batch size 2 x "
                    "data-parallel size 4 = 8"),
    ({"train": 0}, "train_batch_size must be an integer >= 1, got 0"),
    ({"train": 16.5}, "got 16.5"),
    ({"micro": True}, "micro_batch_size must be an integer >= 1, got True"),
    ({}, "exactly one"),
    ({"train": 16, "micro": 2}, "exactly one"),
])
def test_bad_sizes(kwargs: dict, fragment: str) -> None:
    with pytest.raises(ValueError, match=fragment.replace("(", r"\(")):
        new_batch((16, 2, 2), 4, **kwargs)
