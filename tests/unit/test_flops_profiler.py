"""The flops profiler in one process: op pricing (dsrun.profiling.counting),
the per-module tree and report text, and the public API
(FlopsProfiler, get_model_profile) on small models whose counts are worked
out by hand, cross-checked against torch's own FlopCounterMode where both
count the same ops."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

import dsrun
from dsrun.profiling import counting
from dsrun.profiling.flops_profiler import FlopsProfiler, get_model_profile
from dsrun.profiling.tree import (
    ModuleStats,
    Summary,
    aggregated_lines,
    detailed_lines,
    duration_to_string,
    flops_to_string,
    macs_to_string,
    number_to_string,
    params_to_string,
    summary_lines,
)

aten = torch.ops.aten


def cost(func: object, *args: object, **kwargs: object) -> tuple[int, int]:
    out = func(*args, **kwargs)  # type: ignore[operator]
    return counting.op_cost(func, args, kwargs, out)


# ------------------------------------------------------------ op pricing

def test_matrix_products() -> None:
    a, b = torch.ones(3, 5), torch.ones(5, 7)
    assert cost(aten.mm.default, a, b) == (2 * 105, 105)
    assert cost(aten.addmm.default, torch.ones(7), a, b) == (2 * 105 + 21, 105)
    assert cost(aten.addmm.default, torch.ones(7), a, b, beta=0) == (2 * 105, 105)
    assert cost(aten.bmm.default, torch.ones(2, 3, 5), torch.ones(2, 5, 7)) == (420, 210)
    assert cost(aten.mv.default, a, torch.ones(5)) == (30, 15)
    assert cost(aten.dot.default, torch.ones(6), torch.ones(6)) == (12, 6)
    assert counting.matmul_macs((4, 1, 3, 5), (6, 5, 2)) == 4 * 6 * 3 * 5 * 2
    assert counting.matmul_macs((5,), (5, 2)) == 10


def test_out_and_in_place_matrix_products_and_fused_forms() -> None:
    a, b = torch.ones(3, 5), torch.ones(5, 7)
    assert cost(aten.mm.out, a, b, out=torch.empty(3, 7)) == (210, 105)
    assert cost(aten.addmm_.default, torch.zeros(3, 7), a, b) == (210 + 21, 105)
    x, y = torch.ones(2, 3, 5), torch.ones(2, 5, 7)
    assert cost(aten.bmm.out, x, y, out=torch.empty(2, 3, 7)) == (420, 210)
    assert cost(aten.baddbmm_.default, torch.zeros(2, 3, 7), x, y) == (420 + 42, 210)
    assert cost(aten.addbmm_.default, torch.zeros(3, 7), x, y) == (420 + 21, 210)
    assert cost(aten.addmv_.default, torch.zeros(3), a, torch.ones(5)) == (30 + 3, 15)
    # an outer product added to a matrix: k = 1
    assert cost(aten.addr.default, torch.zeros(3, 4), torch.ones(3), torch.ones(4)) == \
        (2 * 12 + 12, 12)
    # addmm fused with its activation: + one flop per output element
    assert cost(aten._addmm_activation.default, torch.zeros(7), a, b) == (210 + 21 + 21, 105)


def test_bilinear_counts_batch_out_in1_in2_macs() -> None:
    batch, in1, in2, out = 2, 4, 5, 3
    layer = nn.Bilinear(in1, in2, out)
    x1, x2 = torch.randn(batch, in1), torch.randn(batch, in2)
    macs = batch * out * in1 * in2  # the hand count: y[b,o] = sum_ij x1[b,i] W[o,i,j] x2[b,j]
    flops, counted_macs, _ = get_model_profile(layer, args=[x1, x2], print_profile=False,
                                               as_string=False)
    assert counted_macs == macs
    assert flops == 2 * macs + batch * out  # + the bias
    assert counting.trilinear_macs([(2, 4), (3, 4, 5), (2, 5)], [(1, 3), (0,), (1, 2)]) == macs
    out_sum = layer(x1, x2).sum()
    prof = FlopsProfiler(layer)
    with prof.counting("backward"):  # the weight's gradient: the same product space
        out_sum.backward()
    assert prof.backward_macs == macs


@pytest.mark.parametrize(("conv", "x_shape"), [
    (nn.Conv2d(3, 8, 3, padding=1), (2, 3, 10, 10)),
    (nn.Conv2d(4, 8, 3, stride=2, groups=2, bias=False), (1, 4, 9, 9)),
    (nn.Conv1d(2, 6, 5), (3, 2, 20)),
    (nn.ConvTranspose2d(4, 6, 3, stride=2), (1, 4, 5, 5)),
])
def test_convolutions_match_the_textbook_count(conv: nn.Module, x_shape: tuple) -> None:
    x = torch.randn(x_shape)
    prof = FlopsProfiler(conv)
    prof.start_profile()
    with torch.no_grad():
        out = conv(x)
    prof.stop_profile()
    kernel = conv.weight[0, 0].numel()
    if isinstance(conv, nn.ConvTranspose2d):
        macs = x.numel() * conv.weight.shape[1] * kernel
    else:
        macs = out.numel() * (conv.in_channels // conv.groups) * kernel
    bias = out.numel() if conv.bias is not None else 0
    assert prof.get_total_macs() == macs
    assert prof.get_total_flops() == 2 * macs + bias


def test_convolution_backward_prices_each_gradient_asked_for() -> None:
    conv = nn.Conv2d(3, 4, 3)
    x = torch.randn(1, 3, 6, 6, requires_grad=True)
    out = conv(x)
    forward_macs = out.numel() * 3 * 9
    prof = FlopsProfiler(conv)
    with prof.counting("backward"):
        out.sum().backward()
    # grad input + grad weight (+ the bias gradient's sum over the output)
    assert prof.backward_macs == 2 * forward_macs


def test_backward_counts_recomputation() -> None:
    """Activation checkpointing re-runs the forward in backward, up to the
    last tensor backward needs: counted there."""
    from torch.utils.checkpoint import checkpoint

    block = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8))
    x = torch.randn(4, 8, requires_grad=True)
    # backward needs tanh's output: the first layer and the tanh are re-run,
    # the last product (whose output nothing saves) is not
    recomputed = (2 * 4 * 8 * 8 + 32) + 32

    def backward_flops(recompute: bool) -> int:
        block.zero_grad(set_to_none=True)
        x.grad = None
        out = checkpoint(block, x, use_reentrant=False) if recompute else block(x)
        prof = FlopsProfiler(block)
        with prof.counting("backward"):
            out.sum().backward()
        return prof.backward_flops

    assert backward_flops(True) - backward_flops(False) == recomputed


def test_attention_kernels() -> None:
    q, k, v = torch.randn(2, 3, 5, 8), torch.randn(2, 3, 7, 8), torch.randn(2, 3, 7, 4)
    macs, scores = counting.attention_macs(q.shape, k.shape, v.shape)
    assert (macs, scores) == (2 * 3 * 5 * 7 * (8 + 4), 2 * 3 * 5 * 7)
    prof = FlopsProfiler(nn.Identity())
    with prof.counting("backward"):  # counts every op, wherever it runs
        F.scaled_dot_product_attention(q, k, v)
    # a fused kernel (CPU flash) or the math path (bmm + softmax): same MACs
    assert prof.backward_macs == macs
    assert prof.backward_flops >= 2 * macs + scores


def test_norms_softmax_pointwise_reductions_and_free_ops() -> None:
    x = torch.randn(4, 6)
    w, b = torch.ones(6), torch.zeros(6)
    assert cost(aten.native_layer_norm.default, x, [6], w, b, 1e-5) == (7 * 24, 0)
    assert cost(aten.native_layer_norm.default, x, [6], None, None, 1e-5) == (5 * 24, 0)
    assert cost(aten._softmax.default, x, 1, False) == (5 * 24, 0)
    assert cost(aten.add.Tensor, x, x) == (24, 0)
    assert cost(aten.gelu.default, x) == (24, 0)
    assert cost(aten.sum.dim_IntList, x, [1]) == (24, 0)
    for free in ((aten.clone.default, x), (aten.eq.Tensor, x, x), (aten.view.default, x, [24]),
                 (aten.embedding.default, torch.randn(10, 3), torch.tensor([1, 2])),
                 (aten.where.self, x > 0, x, x),
                 (aten.sum.default, torch.ones(3, dtype=torch.long))):
        assert cost(*free) == (0, 0), free[0]


# --------------------------------------------------- the profiler on models

class Block(nn.Module):
    """Functional calls, a tensor method and ``@`` inside one module."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.w = nn.Parameter(torch.randn(8, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.proj(x))
        return (h @ self.w).tanh()


def test_module_tree_counts_functional_calls_and_children() -> None:
    model = nn.Sequential(Block(), nn.Linear(8, 3))
    x = torch.randn(5, 8)
    prof = FlopsProfiler(model)
    prof.start_profile()
    model(x)
    prof.stop_profile()
    root = prof.module_stats()
    assert root is not None
    by_name = {s.name: s for _, s in root.walk()}
    assert set(by_name) == {"", "0", "0.proj", "1"}
    proj_macs, matmul_macs, head_macs = 5 * 8 * 8, 5 * 8 * 8, 5 * 8 * 3
    assert by_name["0.proj"].flops == 2 * proj_macs + 40
    # the block's own code: relu (40), h @ w (2 x 320), tanh (40)
    assert by_name["0"].own_flops == 40 + 2 * matmul_macs + 40
    assert by_name["0"].flops == by_name["0"].own_flops + by_name["0.proj"].flops
    assert prof.get_total_macs() == proj_macs + matmul_macs + head_macs
    assert prof.get_total_flops() == by_name["0"].flops + 2 * head_macs + 15
    assert prof.get_total_params() == sum(p.numel() for p in model.parameters())
    assert by_name["0"].params == 8 * 8 + 8 + 64 and by_name["0"].calls == 1
    assert prof.get_total_duration() >= by_name["0"].duration > 0
    # the hooks are gone after stop_profile: running again changes nothing
    model(x)
    assert prof.get_total_macs() == proj_macs + matmul_macs + head_macs
    assert not model[0]._forward_pre_hooks and not model[0]._forward_hooks


def test_a_container_never_called_shows_its_childrens_latency() -> None:
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for layer in self.layers:
                x = layer(x)
            return x

    prof = FlopsProfiler(Net())
    prof.start_profile()
    prof.model(torch.randn(2, 4))
    prof.stop_profile()
    root = prof.module_stats()
    assert root is not None
    container = root.children[0]
    assert container.calls == 0 and container.duration == 0.0
    assert container.latency == sum(c.duration for c in container.children) > 0
    line = next(x for x in detailed_lines(root) if x.lstrip().startswith("layers:"))
    assert "0 us" not in line and "n/a" not in line


def test_matches_torch_flop_counter_on_matmul_only_models() -> None:
    model = nn.Sequential(nn.Linear(16, 32, bias=False), nn.Linear(32, 4, bias=False))
    x = torch.randn(6, 16)
    with FlopCounterMode(display=False) as torch_counter:
        model(x)
    prof = FlopsProfiler(model)
    prof.start_profile()
    model(x)
    prof.stop_profile()
    assert prof.get_total_flops() == torch_counter.get_total_flops()


def test_ops_outside_the_model_ignored_modules_shared_modules_and_errors() -> None:
    shared = nn.Linear(4, 4, bias=False)
    model = nn.Sequential(shared, nn.ReLU(), shared)
    prof = FlopsProfiler(model)
    prof.start_profile(ignore_list=[nn.ReLU])
    out = model(torch.randn(2, 4))
    (out * 2).sum()  # outside the model's forward: not counted
    prof.stop_profile()
    root = prof.module_stats()
    assert root is not None
    assert [s.name for _, s in root.walk()] == ["", "0"]  # "2" is "0"; ReLU ignored
    assert root.children[0].calls == 2 and root.children[0].macs == 2 * 2 * 16
    assert root.own_flops == 2 * 4  # the ignored ReLU counts toward its parent

    class Boom(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            raise ValueError("boom")

    model = nn.Sequential(nn.Linear(4, 4), Boom())
    prof = FlopsProfiler(model)
    prof.start_profile()
    with pytest.raises(ValueError, match="boom"):
        model(torch.randn(2, 4))
    model[0](torch.randn(2, 4))  # the stack recovered: counted under its own module
    prof.stop_profile()
    assert prof.module_stats().children[0].calls == 2  # type: ignore[union-attr]


def test_partitioned_parameters_count_whole() -> None:
    model = nn.Linear(4, 4)
    model.weight.ds_numel = 1000  # type: ignore[attr-defined]  (as ZeRO stage 3 marks them)
    prof = FlopsProfiler(model)
    assert prof.get_total_params() == 1004


def test_get_model_profile(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model = nn.Sequential(nn.Linear(10, 20), nn.ReLU(), nn.Linear(20, 2))
    flops, macs, params = get_model_profile(model, input_shape=(3, 10), as_string=False,
                                            print_profile=False)
    assert macs == 3 * (10 * 20 + 20 * 2)
    assert flops == 2 * macs + 60 + 6 + 60
    assert params == 10 * 20 + 20 + 20 * 2 + 2
    assert capsys.readouterr().out == ""
    text = get_model_profile(model, args=[torch.randn(3, 10)], module_depth=0)
    assert text == ("1.57 K", "720 MACs", "262")
    out = capsys.readouterr().out
    assert "DeepSpeed Flops Profiler" in out and "depth 0:" in out and "depth 1:" not in out
    assert "(model): Sequential(262 = 100.00% Params" in out and "  0: Linear" not in out
    report = tmp_path / "profile.txt"
    get_model_profile(model, kwargs={"input": torch.randn(3, 10)}, output_file=str(report),
                      top_modules=2, detailed=False)
    written = report.read_text()
    assert "Linear: 240, ReLU: 0" not in written and "Linear: 262" in written
    assert "detailed profile" not in written and capsys.readouterr().out == ""
    with pytest.raises(ValueError, match="input_shape, args or kwargs"):
        get_model_profile(model)
    with pytest.raises(ValueError, match="mode"):
        get_model_profile(model, input_shape=(1, 10), mode="train")

    class Generator(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.step = nn.Linear(4, 4, bias=False)

        def generate(self, x: torch.Tensor) -> torch.Tensor:
            for _ in range(3):
                x = self.step(x)
            return x

    _, gen_macs, _ = get_model_profile(Generator(), input_shape=(1, 4), mode="generate",
                                       as_string=False, print_profile=False)
    assert gen_macs == 3 * 16


def test_print_before_profiling_is_an_error() -> None:
    with pytest.raises(RuntimeError, match="start_profile"):
        FlopsProfiler(nn.Linear(2, 2)).print_model_profile()


def test_deepspeed_import_path() -> None:
    import importlib

    module = importlib.import_module("deepspeed.profiling.flops_profiler")
    assert module.get_model_profile is get_model_profile
    inner = importlib.import_module("deepspeed.profiling.flops_profiler.profiler")
    assert inner.FlopsProfiler is FlopsProfiler
    assert dsrun.profiling.flops_profiler.FlopsProfiler is FlopsProfiler


# -------------------------------------------------------------- report text

def test_number_formatting() -> None:
    assert number_to_string(12_345_678) == "12.35 M"
    assert number_to_string(824) == "824" and number_to_string(0) == "0"
    assert number_to_string(2.5e12) == "2.5 T" and number_to_string(1500, units="M") == "0 M"
    assert flops_to_string(3.2e9) == "3.2 GFLOPS" and flops_to_string(12) == "12 FLOPS"
    assert macs_to_string(3072) == "3.07 KMACs" and params_to_string(1e6) == "1 M"
    assert duration_to_string(0.00123) == "1.23 ms" and duration_to_string(2.5) == "2.5 s"
    assert duration_to_string(4e-6) == "4 us" and duration_to_string(0.5, units="s") == "0.5 s"


def tree() -> ModuleStats:
    a = ModuleStats("a", "Linear", params=30, own_flops=200, own_macs=100, duration=0.002,
                    calls=1)
    b = ModuleStats("b", "Linear", params=10, own_flops=20, own_macs=10, duration=0.001,
                    calls=1)
    c = ModuleStats("c", "GELU", params=0, own_flops=5, duration=0.004, calls=1)
    return ModuleStats("", "Net", params=40, own_flops=1, duration=0.01, calls=1,
                       children=[a, b, c])


def test_aggregated_and_detailed_lines() -> None:
    lines = aggregated_lines(tree(), top_modules=2)
    assert lines[1:] == [
        "depth 0:", "    params      - Net: 40", "    MACs        - Net: 110 MACs",
        "    fwd latency - Net: 10 ms", "depth 1:", "    params      - Linear: 40, GELU: 0",
        "    MACs        - Linear: 110 MACs, GELU: 0 MACs",
        "    fwd latency - GELU: 4 ms, Linear: 3 ms"]
    detail = detailed_lines(tree(), module_depth=1)
    assert detail[1] == ("(model): Net(40 = 100.00% Params, 110 MACs = 100.00% MACs, "
                         "10 ms = 100.00% latency, 22.6 KFLOPS)")
    assert detail[2].startswith("  a: Linear(30 = 75.00% Params, 100 MACs = 90.91% MACs")
    assert len(detailed_lines(tree(), module_depth=0)) == 2


def test_summary_lines() -> None:
    s = Summary(step=2, world_size=4, dp_size=4, micro_batches=2, samples=16, params=1000,
                fwd_flops=4_000_000, fwd_macs=2_000_000, bwd_flops=8_000_000,
                fwd_latency=0.002, bwd_latency=0.004, step_latency=0.002)
    text = "\n".join(summary_lines(s))
    assert "fwd FLOPS per rank = fwd flops / fwd latency:" in text and "2 GFLOPS" in text
    assert "iter latency = fwd + bwd + step:" in text and "8 ms" in text
    assert "samples/second per rank:" in text and "2000.00" in text
    forward_only = "\n".join(summary_lines(Summary(
        step=1, world_size=1, dp_size=1, micro_batches=1, samples=0, params=1, fwd_flops=1,
        fwd_macs=0, bwd_flops=0, fwd_latency=0.0, bwd_latency=None, step_latency=None)))
    assert "bwd latency" not in forward_only and "n/a" in forward_only
    assert "samples per rank:" in forward_only and "unknown" in forward_only


def test_get_model_profile_runs_in_eval_mode_and_restores_the_mode() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Dropout(0.5))
    before = model[1].running_mean.clone()
    _, macs, _ = get_model_profile(model, input_shape=(3, 4), as_string=False,
                                   print_profile=False)
    assert macs == 3 * 4 * 4
    assert torch.equal(model[1].running_mean, before)  # BatchNorm did not update
    assert int(model[1].num_batches_tracked) == 0 and model.training  # mode restored
    model.eval()
    get_model_profile(model, input_shape=(3, 4), print_profile=False)
    assert not model.training


@pytest.mark.parametrize("name, build, shape, macs", [
    # seq 5 x batch 2 steps of 4 gates x 16 units over (8 inputs + 16 hidden)
    ("lstm", lambda: nn.LSTM(8, 16, batch_first=True), (2, 5, 8), 2 * 5 * 64 * (8 + 16)),
    # the fused eval path of one encoder layer: q, k, v and output projections
    # (4 x 12 x 16 x 16), scores and weighted sum (2 x 2 x 6 x 6 x 16), the
    # feed-forward (2 x 12 x 16 x 32): what DeepSpeed's profiler counts too
    ("encoder", lambda: nn.TransformerEncoderLayer(16, 2, 32, batch_first=True),
     (2, 6, 16), 4 * 12 * 16 * 16 + 2 * 2 * 6 * 6 * 16 + 2 * 12 * 16 * 32),
])
def test_fused_recurrent_and_attention_kernels_are_counted(name: str, build: Callable,
                                                           shape: tuple, macs: int) -> None:
    """torch runs these as single aten ops on the CPU (mkldnn_rnn_layer,
    _transformer_encoder_layer_fwd, _native_multi_head_attention): counted
    as the products they compute, in eval (fused) as in training (not)."""
    torch.manual_seed(0)
    model = build()
    _, counted, _ = get_model_profile(model, input_shape=shape, as_string=False,
                                      print_profile=False)
    assert counted == macs
    prof = FlopsProfiler(model)
    prof.start_profile()
    model.train()(torch.ones(shape))  # training: the unfused path where torch has one
    prof.stop_profile()
    assert prof.get_total_macs() >= macs


def test_fused_self_attention_matches_the_unfused_count() -> None:
    attention = nn.MultiheadAttention(16, 2, batch_first=True)
    x = torch.randn(2, 6, 16)
    counts = []
    for training in (False, True):
        attention.train(training)
        prof = FlopsProfiler(attention)
        prof.start_profile()
        with torch.no_grad():
            attention(x, x, x)
        prof.stop_profile()
        counts.append(prof.get_total_macs())
    assert counts[0] == counts[1] == 4 * 12 * 16 * 16 + 2 * 2 * 6 * 6 * 16
