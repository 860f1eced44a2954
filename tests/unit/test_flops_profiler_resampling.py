"""Pooling and upsampling in the flops profiler (dsrun/profiling/counting.py).

DeepSpeed 0.19.8 prices these ops in its profiler.py, and dsrun prices
them the same way:

* ``_pool_flops_compute``: a max, average or adaptive pool (1-, 2- or 3-d)
  costs the input's ``numel()``.
* ``_upsample_flops_compute`` (``F.interpolate``): with ``scale_factor``,
  ``int(input.numel() * scale_factor ** spatial_dims)``, or the product of
  the factors when there is one per spatial dimension. With ``size``,
  ``prod(size)``: the output's spatial sizes alone, without batch and
  channels.

The expected values below are computed from those formulas, spelled as
DeepSpeed spells them (:func:`deepspeed_pool`, :func:`deepspeed_upsample`).
Running the same models under DeepSpeed 0.19.8's profiler (bench/.venv-ds,
DS_ACCELERATOR=cpu) gave the same numbers. Before this change dsrun priced
all of these ops at 0.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Optional, Union

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dsrun.profiling import counting
from dsrun.profiling.flops_profiler import (
    FlopsProfiler,
    get_model_profile,
    get_module_flops,
    get_module_macs,
)

aten = torch.ops.aten
pytestmark = pytest.mark.filterwarnings("ignore:`nn.functional.upsample_bilinear` is deprecated")


def deepspeed_pool(shape: Sequence[int]) -> int:
    """DeepSpeed's ``_pool_flops_compute``: ``input.numel()``."""
    n = 1
    for s in shape:
        n *= s
    return n


def deepspeed_upsample(shape: Sequence[int], size: Optional[Sequence[int]] = None,
                       scale_factor: Union[float, Sequence[float], None] = None) -> int:
    """DeepSpeed's ``_upsample_flops_compute`` for ``F.interpolate(x, size=...)``
    (a tuple) or ``F.interpolate(x, scale_factor=...)``."""
    if size is not None:
        return int(deepspeed_pool(size))
    flops = deepspeed_pool(shape)
    if isinstance(scale_factor, (list, tuple)):
        flops *= deepspeed_pool(scale_factor)  # type: ignore[arg-type]
    else:
        flops *= scale_factor ** (len(shape) - 2)  # type: ignore[operator]
    return int(flops)


class Call(nn.Module):
    """A model that runs one functional call."""

    def __init__(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fn(x)


X1, X2, X3 = (2, 3, 8), (2, 3, 8, 8), (1, 2, 4, 4, 4)

POOLS = {
    "max_pool1d": (lambda x: F.max_pool1d(x, 2), X1),
    "max_pool1d indices": (lambda x: F.max_pool1d(x, 2, return_indices=True)[0], X1),
    "max_pool2d": (lambda x: F.max_pool2d(x, 2), X2),
    "max_pool3d": (lambda x: F.max_pool3d(x, 2), X3),
    "avg_pool1d": (lambda x: F.avg_pool1d(x, 2), X1),
    "avg_pool2d": (lambda x: F.avg_pool2d(x, 3, stride=1, padding=1), X2),
    "avg_pool3d": (lambda x: F.avg_pool3d(x, 2), X3),
    "adaptive_avg_pool1d": (lambda x: F.adaptive_avg_pool1d(x, 3), X1),
    "adaptive_avg_pool2d": (lambda x: F.adaptive_avg_pool2d(x, (3, 2)), X2),
    "adaptive_avg_pool2d to 1": (lambda x: F.adaptive_avg_pool2d(x, 1), X2),
    "adaptive_avg_pool3d": (lambda x: F.adaptive_avg_pool3d(x, 2), X3),
    "adaptive_max_pool1d": (lambda x: F.adaptive_max_pool1d(x, 3), X1),
    "adaptive_max_pool2d": (lambda x: F.adaptive_max_pool2d(x, 3), X2),
    "adaptive_max_pool3d": (lambda x: F.adaptive_max_pool3d(x, 2, return_indices=True)[0], X3),
}

UPSAMPLES = {  # call, input shape, DeepSpeed's arguments
    "nearest x2": (lambda x: F.interpolate(x, scale_factor=2), X2, {"scale_factor": 2}),
    "nearest (2, 3)": (lambda x: F.interpolate(x, scale_factor=(2, 3)), X2,
                       {"scale_factor": (2, 3)}),
    "bilinear x1.7": (lambda x: F.interpolate(x, scale_factor=1.7, mode="bilinear"), X2,
                      {"scale_factor": 1.7}),
    "trilinear x1.3": (lambda x: F.interpolate(x, scale_factor=1.3, mode="trilinear"), X3,
                       {"scale_factor": 1.3}),
    "linear x2": (lambda x: F.interpolate(x, scale_factor=2, mode="linear"), X1,
                  {"scale_factor": 2}),
    "nearest-exact x2": (lambda x: F.interpolate(x, scale_factor=2, mode="nearest-exact"), X2,
                         {"scale_factor": 2}),
    "size (5, 7)": (lambda x: F.interpolate(x, size=(5, 7)), X2, {"size": (5, 7)}),
    "bicubic size": (lambda x: F.interpolate(x, size=(5, 7), mode="bicubic"), X2,
                     {"size": (5, 7)}),
    "antialiased size": (lambda x: F.interpolate(x, size=(4, 4), mode="bilinear",
                                                 antialias=True), X2, {"size": (4, 4)}),
    "1-d size": (lambda x: F.interpolate(x, size=[5], mode="linear"), X1, {"size": [5]}),
    "upsample_bilinear": (lambda x: F.upsample_bilinear(x, size=(6, 6)), X2, {"size": (6, 6)}),
    "nn.Upsample": (nn.Upsample(scale_factor=2, mode="bilinear"), X2, {"scale_factor": 2}),
    "nn.UpsamplingNearest2d": (nn.UpsamplingNearest2d(size=(3, 9)), X2, {"size": (3, 9)}),
}


def profile(fn: Callable[[torch.Tensor], torch.Tensor], shape: Sequence[int]
            ) -> tuple[int, int]:
    model = fn if isinstance(fn, nn.Module) else Call(fn)
    flops, macs, _ = get_model_profile(model, input_shape=tuple(shape), print_profile=False,
                                       as_string=False, warm_up=0)
    return flops, macs


@pytest.mark.parametrize("name", POOLS)
def test_pooling_costs_the_inputs_elements(name: str) -> None:
    fn, shape = POOLS[name]
    assert profile(fn, shape) == (deepspeed_pool(shape), 0)


@pytest.mark.parametrize("name", UPSAMPLES)
def test_interpolate_costs_what_deepspeed_counts(name: str) -> None:
    fn, shape, given = UPSAMPLES[name]
    assert profile(fn, shape) == (deepspeed_upsample(shape, **given), 0)


class Resample(nn.Module):
    """Pooling and upsampling modules, and functional calls in the parent."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1, bias=False)
        self.pool = nn.MaxPool2d(2)
        self.avg = nn.AdaptiveAvgPool2d((3, 2))
        self.up = nn.Upsample(scale_factor=2, mode="bilinear")

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        h = self.pool(self.conv(x))
        a = self.avg(h)
        u = self.up(h)
        return (F.avg_pool1d(u.flatten(2), 4), F.interpolate(a, size=(6, 5)),
                F.adaptive_max_pool3d(u, (2, 3, 3)))


def test_per_module_figures_equal_deepspeeds() -> None:
    model = Resample()
    prof = FlopsProfiler(model)
    prof.start_profile()
    model(torch.randn(2, 3, 8, 8))
    conv_macs = 2 * 4 * 8 * 8 * 3 * 3 * 3
    own = {  # (__flops__, __macs__): what each module's own forward runs
        "conv": (2 * conv_macs, conv_macs),
        "pool": (deepspeed_pool((2, 4, 8, 8)), 0),
        "avg": (deepspeed_pool((2, 4, 4, 4)), 0),
        "up": (deepspeed_upsample((2, 4, 4, 4), scale_factor=2), 0),
        "": (deepspeed_pool((2, 4, 64)) + deepspeed_upsample((2, 4, 3, 2), size=(6, 5))
             + deepspeed_pool((2, 4, 8, 8)), 0),
    }
    for name, module in model.named_modules():
        assert (module.__flops__, module.__macs__) == own[name], name
    assert (get_module_flops(model), get_module_macs(model)) == (29854, conv_macs)
    assert sum(f for f, _ in own.values()) == 29854  # DeepSpeed 0.19.8's total for this input
    prof.end_profile()


def test_op_prices_and_backward() -> None:
    x = torch.randn(2, 3, 8, 8)
    cost = counting.op_cost
    out = aten.max_pool2d_with_indices.default(x, [2, 2])
    assert cost(aten.max_pool2d_with_indices.default, (x, [2, 2]), {}, out) == (384, 0)
    up = aten.upsample_nearest2d.default(x, [12, 12], 1.5, 1.5)
    assert cost(aten.upsample_nearest2d.default, (x, [12, 12], 1.5, 1.5), {}, up) == (864, 0)
    assert cost(aten.upsample_nearest2d.default, (x, [12, 12]), {}, up) == (144, 0)
    # the .vec overloads, scales given by keyword
    vec = aten.upsample_bilinear2d.vec
    assert cost(vec, (x, None, False), {"scale_factors": [2.0, 3.0]}, None) == (2304, 0)
    assert counting.upsample_flops(128, None, [1.3, 1.3, 1.3]) == int(128 * 1.3 ** 3)
    # the backward: one flop per element of the input's gradient (pooling) or of
    # the output's gradient (upsampling)
    prof = FlopsProfiler(nn.Identity())
    for fn, expected in ((lambda t: F.max_pool2d(t, 2), 384),
                         (lambda t: F.avg_pool2d(t, 2), 384),
                         (lambda t: F.adaptive_avg_pool2d(t, 3), 384),
                         (lambda t: F.interpolate(t, scale_factor=2), 1536)):
        t = x.clone().requires_grad_()
        y = fn(t)
        prof.backward_flops = 0
        with prof.counting("backward"):
            torch.autograd.grad(y, t, torch.ones_like(y))
        assert prof.backward_flops == expected
