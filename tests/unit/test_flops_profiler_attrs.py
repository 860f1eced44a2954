"""DeepSpeed's per-module profile attributes (``__flops__``, ``__macs__``,
``__params__``, ``__duration__``) and ``get_module_flops`` /
``get_module_macs`` / ``get_module_duration``
(dsrun/profiling/module_attrs.py).

The expected figures are DeepSpeed 0.19.8's, printed by its profiler
(bench/.venv-ds, DS_ACCELERATOR=cpu) for the same models and pasted here.
Where DeepSpeed prices an op differently on purpose (README, "How it
differs from DeepSpeed's"), MACs and parameters are still DeepSpeed's and
the flops differ by exactly the documented price.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import dsrun  # noqa: F401 - installs the deepspeed alias
from dsrun.profiling.flops_profiler import (
    FlopsProfiler,
    get_module_duration,
    get_module_flops,
    get_module_macs,
)

# get_module_flops, get_module_macs, __flops__, __macs__, __params__
Row = tuple[int, int, int, int, int]


class Stack(nn.Module):
    """Embedding, convolution, a ModuleList its parent iterates, a ReLU
    module called twice and a linear layer called twice (shared)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(50, 16)
        self.conv = nn.Conv1d(16, 8, 3, padding=1)
        self.blocks = nn.ModuleList([nn.Linear(8, 8, bias=False), nn.Linear(8, 8, bias=False)])
        self.act = nn.ReLU()
        self.head = nn.Linear(8, 4, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.conv(self.emb(ids).transpose(1, 2)).transpose(1, 2)
        for block in self.blocks:
            x = self.act(block(x))
        return self.head(self.blocks[0](x))


# DeepSpeed 0.19.8 on Stack()(ids of shape (2, 5)).
DEEPSPEED_STACK: dict[str, Row] = {
    "": (12400, 6080, 0, 0, 1352), "emb": (0, 0, 0, 0, 800),
    "conv": (7760, 3840, 7760, 3840, 392), "blocks": (3840, 1920, 0, 0, 128),
    "blocks.0": (2560, 1280, 2560, 1280, 64), "blocks.1": (1280, 640, 1280, 640, 64),
    "act": (160, 0, 160, 0, 0), "head": (640, 320, 640, 320, 32),
}
# ... and with ignore_list=[nn.ReLU]: its flops count toward the caller.
DEEPSPEED_STACK_RELU_IGNORED = {**DEEPSPEED_STACK, "": (12400, 6080, 160, 0, 1352),
                                "act": (0, 0, 0, 0, 0)}


def rows(model: nn.Module) -> dict[str, Row]:
    return {name: (get_module_flops(m), get_module_macs(m), m.__flops__, m.__macs__,
                   m.__params__) for name, m in model.named_modules()}


def profiled(model: nn.Module, *inputs: torch.Tensor, ignore_list: object = None
             ) -> FlopsProfiler:
    prof = FlopsProfiler(model)
    prof.start_profile(ignore_list=ignore_list)  # type: ignore[arg-type]
    model(*inputs)
    return prof


def test_per_module_attributes_and_sums_equal_deepspeeds() -> None:
    torch.manual_seed(0)
    ids = torch.randint(0, 50, (2, 5))
    for ignore, expected in ((None, DEEPSPEED_STACK), ([nn.ReLU], DEEPSPEED_STACK_RELU_IGNORED)):
        model = Stack()
        prof = profiled(model, ids, ignore_list=ignore)
        assert rows(model) == expected
        assert (prof.get_total_flops(), prof.get_total_macs()) == expected[""][:2]
        assert all(m.__expert_params__ == m.__model_expert_params__ == 0
                   for m in model.modules())
        prof.end_profile()


def test_attributes_live_from_start_to_end_profile() -> None:
    model = nn.Sequential(nn.Linear(4, 3, bias=False), nn.ReLU())
    prof = FlopsProfiler(model)
    with pytest.raises(AttributeError, match="start_profile"):
        get_module_flops(model)
    prof.start_profile()
    assert rows(model)[""] == (0, 0, 0, 0, 12)  # set, zero, before any forward
    model(torch.ones(2, 4))
    assert rows(model)["0"] == (48, 24, 48, 24, 12)  # 2 x 3 outputs x 4 MACs
    model(torch.ones(2, 4))
    assert get_module_macs(model) == 48  # every call adds, as DeepSpeed's accumulators
    prof.stop_profile()
    model(torch.ones(2, 4))  # not profiled: the figures stay as they were
    assert get_module_macs(model) == 48 and get_module_flops(model[1]) == 12
    prof.reset_profile()
    assert rows(model)["0"] == (0, 0, 0, 0, 12) and model[0].__duration__ == 0
    prof.end_profile()
    assert not any(hasattr(m, name) for m in model.modules()
                   for name in ("__flops__", "__macs__", "__params__", "__duration__",
                                "__expert_params__"))


def test_module_duration_and_never_called_containers() -> None:
    model = Stack()
    prof = profiled(model, torch.randint(0, 50, (2, 5)))
    blocks = model.blocks
    assert blocks.__duration__ == 0  # a ModuleList is never called itself
    assert get_module_duration(blocks) == blocks[0].__duration__ + blocks[1].__duration__ > 0
    assert get_module_duration(model) == model.__duration__ > 0
    assert get_module_duration(model.head) == model.head.__duration__ > 0
    assert prof.get_total_duration() == model.__duration__
    prof.end_profile()


# DeepSpeed 0.19.8: (get_module_flops, get_module_macs, __params__) of single layers.
class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(16, 48)
        self.out = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).view(2, 5, 3, 2, 8).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v)
        return self.out(y.transpose(1, 2).reshape(2, 5, 16))


def test_single_layers_against_deepspeed() -> None:
    torch.manual_seed(0)
    ids = torch.randint(0, 50, (2, 5))
    cases = [  # model, input, DeepSpeed's (flops, macs, params), dsrun's extra flops
        (nn.Linear(16, 8, bias=False), torch.randn(3, 16), (768, 384, 128), 0),
        (nn.Conv2d(3, 4, 3, stride=2, padding=1), torch.randn(2, 3, 9, 9), (11000, 5400, 112), 0),
        (nn.Embedding(50, 16), ids, (0, 0, 800), 0),
        # documented prices: +1 flop per element of an added bias (3 x 8) ...
        (nn.Linear(16, 8), torch.randn(3, 16), (768, 384, 136), 3 * 8),
        # ... layer norm 5 + weight + bias per element (DeepSpeed: 5 in all) ...
        (nn.LayerNorm(16), torch.randn(3, 16), (240, 0, 32), 2 * 3 * 16),
        # ... the biases (2 x 5 x (48 + 16)) and 5 per attention score (2 x 2 x 5 x 5)
        (Attention(), torch.randn(2, 5, 16), (23680, 11840, 1088), 640 + 500),
    ]
    for model, x, (flops, macs, params), extra in cases:
        prof = profiled(model, x)
        assert (get_module_flops(model), get_module_macs(model), model.__params__) == \
            (flops + extra, macs, params), type(model).__name__
        prof.end_profile()


def test_deepspeed_import_paths() -> None:
    import importlib

    for path in ("deepspeed.profiling.flops_profiler",
                 "deepspeed.profiling.flops_profiler.profiler"):
        module = importlib.import_module(path)
        assert (module.get_module_flops, module.get_module_macs, module.get_module_duration) == \
            (get_module_flops, get_module_macs, get_module_duration)
