"""``fp16.auto_cast`` casts as DeepSpeed's does, in this process (the ``solo``
group): floating tensors among the module's positional arguments (inside
lists, tuples and dicts too) become fp16 before every call of the module -
``engine(...)`` and ``engine.module(...)`` alike - while keyword arguments
and integer tensors keep their dtype; without ``auto_cast`` nothing is
cast, and ``destroy()`` removes the cast."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import dsrun

pytestmark = pytest.mark.dist


class Recorder(torch.nn.Module):
    """Records the dtypes it is called with."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(3, 1)
        self.seen: list[dict[str, Any]] = []

    def forward(self, x: Any, extra: Any = None, *, w: Any = None) -> torch.Tensor:
        first = x[0] if isinstance(x, list) else x
        self.seen.append({
            "x": [first.dtype, x[1]["a"].dtype, x[1]["ids"].dtype] if isinstance(x, list)
            else x.dtype,
            "extra": None if extra is None else extra.dtype,
            "w": None if w is None else w.dtype})
        return self.lin(first.to(self.lin.weight.dtype))


def engine_for(stage: int, auto_cast: bool) -> Any:
    torch.manual_seed(0)
    config = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 1000,
              "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
              "fp16": {"enabled": True, "auto_cast": auto_cast},
              "zero_optimization": {"stage": stage}}
    engine, *_ = dsrun.initialize(model=Recorder(), config=config)
    return engine


F32, F16, I64 = torch.float32, torch.float16, torch.int64


@pytest.mark.parametrize("stage", [0, 3])
def test_positional_floating_inputs_are_cast_before_every_call(solo: None, stage: int) -> None:
    engine = engine_for(stage, auto_cast=True)
    x = torch.ones(2, 3)
    engine(x, x, w=x)
    engine.module(x)
    engine([x, {"a": x, "ids": torch.ones(2, dtype=I64)}])
    engine(x=x)
    seen = engine.module.seen
    assert seen[0] == {"x": F16, "extra": F16, "w": F32}  # keyword arguments are not cast
    assert seen[1] == {"x": F16, "extra": None, "w": None}  # engine.module(...) is cast too
    assert seen[2]["x"] == [F16, F16, I64]
    assert seen[3]["x"] == F32  # passed by keyword
    engine.destroy()
    engine.module(x)
    assert seen[4]["x"] == F32


def test_without_auto_cast_nothing_is_cast(solo: None) -> None:
    engine = engine_for(0, auto_cast=False)
    x = torch.ones(2, 3)
    engine(x, x)
    engine.module(x)
    assert engine.module.seen == [{"x": F32, "extra": F32, "w": None},
                                  {"x": F32, "extra": None, "w": None}]
