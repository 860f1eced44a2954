"""partition_method="flops": each layer's forward + backward flops counted on
torch's meta device (no process group, nothing allocated)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from dsrun.errors import DsrunConfigError
from dsrun.pipe import LayerSpec, TiedLayerSpec
from dsrun.runtime.pipe.costs import layer_flops
from dsrun.runtime.pipe.layers import build_on_meta, count_parameters
from dsrun.runtime.pipe.partition import partition_balanced, partition_layers

B, IN, OUT = 3, 5, 7


def test_linear_layers_cost_their_products_forward_and_backward() -> None:
    layers = [LayerSpec(nn.Linear, IN, OUT, bias=False), LayerSpec(nn.Linear, OUT, IN, bias=False)]
    # first layer: forward x @ W^T and the weight's gradient (its input needs none);
    # the second also passes a gradient back to the first: one product more
    assert layer_flops(layers, torch.zeros(B, IN)) == [2 * 2 * B * IN * OUT, 3 * 2 * B * IN * OUT]


def test_bias_activation_loss_and_recomputation() -> None:
    layers = [LayerSpec(nn.Linear, IN, OUT), nn.ReLU(), LayerSpec(nn.Linear, OUT, IN)]
    x = torch.zeros(B, IN)
    plain = layer_flops(layers, x)
    # addmm: the product plus one add per output element; the bias gradient: a sum
    assert plain[0] == 2 * B * IN * OUT + B * OUT + 2 * B * IN * OUT + B * OUT
    assert plain[1] == 2 * B * OUT  # relu and its backward, one flop per element each
    with_loss = layer_flops(layers, x, loss_fn=F.cross_entropy,
                            example_labels=torch.zeros(B, dtype=torch.long))
    assert with_loss[:2] == plain[:2] and with_loss[2] > plain[2]  # only the last layer
    again = layer_flops(layers, x, recomputed=[True, False, False])
    assert again[0] == plain[0] + 2 * B * IN * OUT + B * OUT and again[1:] == plain[1:]


def test_tied_layers_functions_tuples_and_module_instances() -> None:
    vocab, dim, seq = 50, 8, 6

    def logits(embedding: nn.Embedding, h: torch.Tensor) -> torch.Tensor:
        return h @ embedding.weight.t()

    def pair(h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return h, h * 2

    def join(p: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return p[0] + p[1]

    built = nn.Linear(dim, dim)  # a module given already built, on the CPU
    layers: list[Any] = [TiedLayerSpec("embed", nn.Embedding, vocab, dim), pair, join, built,
                         TiedLayerSpec("embed", nn.Embedding, vocab, dim, forward_fn=logits)]
    costs = layer_flops(layers, torch.zeros(2, seq, dtype=torch.long))
    tokens = 2 * seq
    assert costs[0] == 0  # a lookup; its gradient is a scatter, not priced
    # h * 2, its gradient, and the sum of the two gradients that reach h
    assert costs[1] == 3 * tokens * dim
    assert costs[2] == tokens * dim  # the add (its gradient is passed through)
    assert costs[3] == 3 * 2 * tokens * dim * dim + 2 * tokens * dim
    # three products, and the tied weight's gradient added to the first use's
    assert costs[4] == 3 * 2 * tokens * dim * vocab + vocab * dim
    assert built.weight.device.type == "cpu" and built.weight.grad is None  # untouched


def test_work_not_parameters_is_balanced() -> None:
    # a convolution: few parameters, much work; a linear head: many parameters, little work
    layers = [LayerSpec(nn.Conv2d, 3, 16, 3, padding=1), LayerSpec(nn.Conv2d, 16, 16, 3, padding=1),
              LayerSpec(nn.Conv2d, 16, 16, 3, padding=1), LayerSpec(nn.Flatten),
              LayerSpec(nn.Linear, 16 * 32 * 32, 64)]
    names = [spec.name for spec in layers]
    counts = [count_parameters(spec) for spec in layers]
    flops = layer_flops(layers, torch.zeros(8, 3, 32, 32))
    by_params = partition_layers("parameters", 2, names, counts)
    by_flops = partition_layers("flops", 2, names, counts, flops)
    assert by_params == (0, 4, 5)  # the head's 1M parameters weigh as much as the rest
    assert by_flops == partition_balanced(flops, 2) == (0, 2, 5)

    def worst(bounds: tuple[int, ...]) -> int:
        return max(sum(flops[a:b]) for a, b in zip(bounds, bounds[1:]))
    assert worst(by_flops) < worst(by_params) / 1.4


def test_bad_inputs_name_the_problem() -> None:
    class NeedsData(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * float(x.sum().item())  # data-dependent: no meta run

    with pytest.raises(DsrunConfigError, match="needs example_inputs="):
        layer_flops([LayerSpec(nn.Linear, IN, OUT)], None)
    with pytest.raises(DsrunConfigError, match=r"layer 1 \(NeedsData\) cannot run on torch's "
                                               r"meta device"):
        layer_flops([LayerSpec(nn.Linear, IN, OUT), LayerSpec(NeedsData)], torch.zeros(B, IN))
    with pytest.raises(DsrunConfigError, match=r"layer 0 \(Linear\) cannot run"):
        layer_flops([LayerSpec(nn.Linear, IN, OUT)], torch.zeros(B, IN + 1))  # wrong shape
    with pytest.raises(DsrunConfigError, match="'flops' balances"):
        partition_layers("profile", 2, ["a", "b"], [1, 1])
    with pytest.raises(ValueError, match="one flop count per layer"):
        partition_layers("flops", 2, ["a", "b"], [1, 1], None)


def test_meta_builds_skip_initialisation_but_keep_shapes() -> None:
    class Inits(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Parameter(torch.empty(4, 3))
            self.b = nn.Parameter(torch.empty(5))
            nn.init.trunc_normal_(self.a, std=0.02)
            nn.init.normal_(tensor=self.b)
            self.c = nn.Embedding(6, 2)

    module = build_on_meta(LayerSpec(Inits))
    assert {n: (tuple(p.shape), p.device.type) for n, p in module.named_parameters()} == {
        "a": ((4, 3), "meta"), "b": ((5,), "meta"), "c.weight": ((6, 2), "meta")}
    real = Inits()  # outside the meta build, initialisation runs as usual
    assert real.a.abs().max() > 0 and real.b.abs().max() > 0

    class CpuOnly(nn.Module):  # a constructor that needs real data
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.tensor([float(torch.ones(2).sum().item())]))

    assert build_on_meta(LayerSpec(CpuOnly)).w.is_meta


def test_sizing_specs_does_not_import_dynamo() -> None:
    """torch's meta normal_ imports torch._dynamo (~2 s) on first use; sizing
    specs for "parameters" (every pipeline's default) skips initialisation."""
    import subprocess
    import sys

    code = ("import sys, torch, torch.nn as nn\n"
            "from dsrun.pipe import LayerSpec\n"
            "from dsrun.runtime.pipe.layers import count_parameters\n"
            "n = sum(count_parameters(LayerSpec(c, *a)) for c, a in [(nn.Embedding, (50, 8)), "
            "(nn.Linear, (8, 8)), (nn.LayerNorm, (8,)), (nn.MultiheadAttention, (8, 2))])\n"
            "print(n, 'torch._dynamo' in sys.modules)\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0, res.stderr
    expected = 50 * 8 + 72 + 16 + sum(p.numel() for p in nn.MultiheadAttention(8, 2).parameters())
    assert res.stdout.split() == [str(expected), "False"]
