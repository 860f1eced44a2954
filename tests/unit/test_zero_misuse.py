"""released_use_error: torch's empty-gradient error for a released ZeRO-3
parameter becomes one naming the parameter; anything else is left alone."""

from __future__ import annotations

import torch
from torch import nn

from dsrun.runtime.zero.misuse import released_use_error

TORCH_MESSAGE = ("Function PowBackward0 returned an invalid gradient at index 0 - got [0] "
                 "but expected shape compatible with [3, 2]")


def _released(module: nn.Module) -> nn.Module:
    for p in module.parameters():
        p.ds_shape = p.data.shape
        p.data = torch.empty(0)
    return module


def test_names_the_released_parameters_of_that_shape() -> None:
    model = _released(nn.Sequential(nn.Linear(2, 3), nn.Linear(3, 3)))
    err = released_use_error(model, RuntimeError(TORCH_MESSAGE))
    assert err is not None
    assert "shape [3, 2]" in str(err)
    assert "of that shape: 0.weight." in str(err)


def test_a_parameter_held_whole_is_not_named() -> None:
    model = nn.Linear(2, 3)
    model.weight.ds_shape = model.weight.shape
    assert released_use_error(model, RuntimeError(TORCH_MESSAGE)) is None


def test_other_errors_are_left_alone() -> None:
    model = _released(nn.Linear(2, 3))
    other = RuntimeError("mat1 and mat2 shapes cannot be multiplied")
    assert released_use_error(model, other) is None
    assert released_use_error(model, KeyboardInterrupt()) is None
