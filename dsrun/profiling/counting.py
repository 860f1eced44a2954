"""How many floating-point operations and multiply-accumulates an aten op costs.

The flops profiler sees every operator torch dispatches (``aten.*``, after
autograd and after composite operators such as ``linear`` or ``matmul``
have been decomposed), so it counts what actually runs, whether a model
calls modules, ``torch.nn.functional``, tensor methods or ``@``. This
module is the pure arithmetic: :func:`op_cost` maps an op and its
arguments/output to ``(flops, macs)``, reading only shapes.

The rules (documented in the README's flops-profiler section):

* matrix products (``mm``, ``bmm``, ``addmm``, ``baddbmm``, ``mv``, ``dot``,
  ``addr``..., also their ``out=`` and in-place forms): one MAC per
  multiply-add, 2 flops per MAC, plus one flop per element of an added
  ``input`` term (and of ``_addmm_activation``'s activation);
* ``_trilinear`` (``nn.Bilinear``, ``F.bilinear``, and their backward): one
  MAC per point of the three inputs' broadcast product (batch x out x in1 x
  in2 for a bilinear layer), 2 flops per MAC;
* convolutions: output elements x input channels per group x kernel size
  MACs (transposed: input elements x output channels per group x kernel);
  their backward: one forward's MACs per gradient asked for;
* scaled-dot-product attention kernels: ``QK^T`` and ``PV`` MACs (L x S x
  (E + Ev) per batch and head), plus 5 flops per attention score for the
  softmax; backward: twice the forward MACs;
* pointwise ops (torch's ``pointwise`` tag): one flop per element of a
  floating-point output, except ops that only move or select data
  (``clone``, ``where``, fills...); comparisons and masks are not flops;
* reductions (torch's ``reduction`` tag): one flop per floating-point input
  element;
* softmax / log-softmax: 5 flops per element (max, subtract, exp, sum,
  divide), their backward 3; layer/group/batch norm: 5 per element, +1 for
  a weight, +1 for a bias, backward twice that; RMS norm 3 (+1 weight);
* pooling (max, average, adaptive; 1-d pools run as 2-d ones): one flop
  per element of the pooled input, DeepSpeed's price; their backward one
  per element of the input's gradient;
* upsampling (``F.interpolate``): DeepSpeed's price, from what the call
  was given - with scale factors, the input's elements times their
  product; with a size, the product of the output's spatial sizes alone
  (batch and channels not multiplied in, as in DeepSpeed); the backward
  one flop per element of the output's gradient;
* everything else (views, copies, indexing, embedding lookups, collectives,
  random number generation): 0.

MACs are only counted for the products above, so ``flops >= 2 * macs``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Callable, Optional

import torch

__all__ = ["op_cost", "matmul_macs", "conv_macs", "attention_macs", "trilinear_macs",
           "upsample_flops"]

Cost = tuple[int, int]  # (flops, macs)
_NONE: Cost = (0, 0)

aten = torch.ops.aten


def _numel(shape: Sequence[int]) -> int:
    return math.prod(int(s) for s in shape)


def _first_tensor(values: Any) -> Optional[torch.Tensor]:
    if isinstance(values, torch.Tensor):
        return values
    if isinstance(values, (list, tuple)):
        for v in values:
            found = _first_tensor(v)
            if found is not None:
                return found
    return None


def matmul_macs(a: Sequence[int], b: Sequence[int]) -> int:
    """MACs of ``a @ b`` for shapes ``[..., m, k]`` x ``[..., k, n]`` (1-d
    operands as in ``torch.matmul``; batch dimensions broadcast)."""
    if len(a) == 0 or len(b) == 0:
        return 0
    a2 = (1, *a) if len(a) == 1 else tuple(a)
    b2 = (*b, 1) if len(b) == 1 else tuple(b)
    m, k = a2[-2], a2[-1]
    n = b2[-1]
    batch = torch.broadcast_shapes(a2[:-2], b2[:-2])
    return _numel(batch) * m * k * n


def conv_macs(x: Sequence[int], weight: Sequence[int], out: Sequence[int],
              transposed: bool) -> int:
    """MACs of a (possibly transposed, possibly grouped) convolution from its
    shapes. ``weight`` is ``[Cout, Cin/groups, *k]``, or ``[Cin, Cout/groups,
    *k]`` when transposed, so the group count is already in ``weight[1]``."""
    kernel = _numel(weight[2:])
    if transposed:
        return _numel(x) * int(weight[1]) * kernel
    return _numel(out) * int(weight[1]) * kernel


def attention_macs(q: Sequence[int], k: Sequence[int], v: Sequence[int]) -> tuple[int, int]:
    """(MACs, attention scores) of ``softmax(Q K^T) V`` for ``[..., L, E]``,
    ``[..., S, E]``, ``[..., S, Ev]``."""
    batch = _numel(torch.broadcast_shapes(tuple(q[:-2]), tuple(k[:-2])))
    length, source, e, ev = int(q[-2]), int(k[-2]), int(q[-1]), int(v[-1])
    scores = batch * length * source
    return scores * (e + ev), scores


# ------------------------------------------------------------- the rules

def _product(a_index: int, b_index: int, adds_input: bool = False
             ) -> Callable[[tuple, dict, Any], Cost]:
    """``args[a_index] @ args[b_index]``, plus ``beta * input`` for the
    ``add*`` forms (one flop per output element unless ``beta`` is 0)."""
    def rule(args: tuple, kwargs: dict, out: Any) -> Cost:
        macs = matmul_macs(args[a_index].shape, args[b_index].shape)
        flops = 2 * macs
        if adds_input and isinstance(out, torch.Tensor):
            beta = kwargs.get("beta", 1)
            if beta != 0:
                flops += out.numel()
        return flops, macs
    return rule


def _addmm_activation(args: tuple, kwargs: dict, out: Any) -> Cost:
    """``act(beta * input + mat1 @ mat2)`` (addmm fused with ReLU or GELU)."""
    flops, macs = _product(1, 2, adds_input=True)(args, kwargs, out)
    return flops + (out.numel() if isinstance(out, torch.Tensor) else 0), macs


def _outer_product(args: tuple, kwargs: dict, out: Any) -> Cost:
    """``addr``: ``beta * input + vec1 (x) vec2``, a matrix product with k = 1."""
    macs = int(args[1].numel()) * int(args[2].numel())
    beta = kwargs.get("beta", 1)
    return 2 * macs + (macs if beta != 0 else 0), macs


def trilinear_macs(shapes: Sequence[Sequence[int]], expands: Sequence[Sequence[int]]) -> int:
    """MACs of ``aten._trilinear``: each input gets size-1 dimensions at its
    ``expand`` positions, the three are multiplied with broadcasting and the
    product is summed over some dimensions - one MAC per point of the
    broadcast product."""
    full = []
    for shape, expand in zip(shapes, expands):
        dims = list(shape)
        for position in sorted(expand):
            dims.insert(position, 1)
        full.append(tuple(dims))
    return _numel(torch.broadcast_shapes(*full))


def _trilinear(args: tuple, kwargs: dict, out: Any) -> Cost:
    # _trilinear(i1, i2, i3, expand1, expand2, expand3, sumdim, unroll_dim)
    macs = trilinear_macs([a.shape for a in args[:3]], args[3:6])
    return 2 * macs, macs


def _dot(args: tuple, kwargs: dict, out: Any) -> Cost:
    macs = int(args[0].numel())
    return 2 * macs, macs


def _convolution(args: tuple, kwargs: dict, out: Any) -> Cost:
    x, weight = args[0], args[1]
    transposed = bool(args[6]) if len(args) > 6 else bool(kwargs.get("transposed", False))
    macs = conv_macs(x.shape, weight.shape, out.shape, transposed)
    bias = args[2] if len(args) > 2 else kwargs.get("bias")
    extra = out.numel() if isinstance(bias, torch.Tensor) else 0
    return 2 * macs + extra, macs


def _conv_impl(args: tuple, kwargs: dict, out: Any) -> Cost:
    """cudnn/mkldnn entry points: (input, weight, [bias,] ...) not transposed."""
    x, weight = args[0], args[1]
    out_t = _first_tensor(out)
    macs = conv_macs(x.shape, weight.shape, out_t.shape, False) if out_t is not None else 0
    return 2 * macs, macs


def _convolution_backward(args: tuple, kwargs: dict, out: Any) -> Cost:
    grad_out, x, weight = args[0], args[1], args[2]
    # (grad_output, input, weight, bias_sizes, stride, padding, dilation, transposed,
    #  output_padding, groups, output_mask)
    transposed, mask = bool(args[7]), args[10]
    forward = conv_macs(x.shape, weight.shape, grad_out.shape, transposed)
    macs = forward * (int(bool(mask[0])) + int(bool(mask[1])))
    flops = 2 * macs + (grad_out.numel() if mask[2] else 0)
    return flops, macs


def _attention(args: tuple, kwargs: dict, out: Any) -> Cost:
    macs, scores = attention_macs(args[0].shape, args[1].shape, args[2].shape)
    return 2 * macs + 5 * scores, macs


def _attention_backward(args: tuple, kwargs: dict, out: Any) -> Cost:
    # (grad_out, query, key, value, ...) for every fused attention backward
    macs, scores = attention_macs(args[1].shape, args[2].shape, args[3].shape)
    return 4 * macs + 3 * scores, 2 * macs


def _per_element(factor: int, arg: int = 0) -> Callable[[tuple, dict, Any], Cost]:
    def rule(args: tuple, kwargs: dict, out: Any) -> Cost:
        t = args[arg] if len(args) > arg else None
        return (factor * t.numel(), 0) if isinstance(t, torch.Tensor) else _NONE
    return rule


def _norm(weight_at: int, bias_at: int, factor: int = 1) -> Callable[[tuple, dict, Any], Cost]:
    def rule(args: tuple, kwargs: dict, out: Any) -> Cost:
        per = 5
        for i in (weight_at, bias_at):
            if len(args) > i and isinstance(args[i], torch.Tensor):
                per += 1
        return factor * per * args[0].numel(), 0
    return rule


def _rms_norm(args: tuple, kwargs: dict, out: Any) -> Cost:
    weight = args[2] if len(args) > 2 else kwargs.get("weight")
    per = 3 + (1 if isinstance(weight, torch.Tensor) else 0)
    return per * args[0].numel(), 0


# Pointwise flops per hidden unit and step of one recurrent cell, besides its
# two matrix products: the products' sum (one add per gate row) and the gate
# activations and state updates (LSTM: 3 sigmoids and 2 tanh, 3 muls, 1 add;
# GRU: 2 sigmoids and 1 tanh, 3 muls, 2 adds, 1 sub; RNN: its activation).
_RNN_POINTWISE = {0: 1 + 1, 1: 1 + 1, 2: 4 + 9, 3: 3 + 9}  # cuDNN/oneDNN mode numbers


def _rnn_products(inputs: torch.Tensor, w_ih: torch.Tensor, w_hh: torch.Tensor) -> int:
    """MACs of one recurrent layer and direction: at every step of every
    sequence, the input times ``w_ih`` and the hidden state times ``w_hh``."""
    steps = inputs.numel() // inputs.shape[-1]  # sequence length x batch
    return steps * w_ih.shape[0] * (w_ih.shape[1] + w_hh.shape[1])


def _rnn_layer(args: tuple, kwargs: dict, out: Any) -> Cost:
    # mkldnn_rnn_layer(input, w_ih, w_hh, b_ih, b_hh, hx, cx, reverse, batch_sizes, mode,
    #                  hidden_size, num_layers, has_biases, ...): one layer, one direction
    inputs, w_ih, w_hh, mode, hidden, has_biases = (args[0], args[1], args[2], args[9],
                                                    args[10], args[12])
    macs = _rnn_products(inputs, w_ih, w_hh)
    steps = inputs.numel() // inputs.shape[-1]
    biases = 2 * w_ih.shape[0] * steps if has_biases else 0
    return 2 * macs + biases + _RNN_POINTWISE.get(mode, 0) * hidden * steps, macs


def _rnn_layer_backward(args: tuple, kwargs: dict, out: Any) -> Cost:
    # the gradients of the input/hidden state and of both weights: twice the products
    macs = 2 * _rnn_products(args[0], args[1], args[2])
    return 2 * macs, macs


def _attention_block(q_rows: int, kv_rows: int, batch: int, lq: int, lk: int, embed: int,
                     heads: int) -> Cost:
    """A multi-head attention block with its input and output projections
    (biases included): what torch's fused kernels compute in one call."""
    projections = (q_rows + 2 * kv_rows) * embed * embed + q_rows * embed * embed
    attention = 2 * batch * lq * lk * embed  # QK^T and the weighted sum, all heads
    scores = batch * heads * lq * lk
    macs = projections + attention
    biases = (q_rows + 2 * kv_rows) * embed + q_rows * embed
    return 2 * macs + biases + 5 * scores + q_rows * embed, macs  # + softmax, q scaling


def _rows(t: torch.Tensor) -> int:
    return t.numel() // t.shape[-1]


def _native_mha(args: tuple, kwargs: dict, out: Any) -> Cost:
    # _native_multi_head_attention(query, key, value, embed_dim, num_head, ...): the
    # fast path of nn.MultiheadAttention (eval, batch_first)
    q, k = args[0], args[1]
    batch = q.shape[0] if q.dim() == 3 else 1
    return _attention_block(_rows(q), _rows(k), batch, q.shape[-2], k.shape[-2], args[3],
                            args[4])


def _encoder_layer(args: tuple, kwargs: dict, out: Any) -> Cost:
    # _transformer_encoder_layer_fwd(src, embed_dim, num_heads, ..., ffn_weight_1 (F, E)
    # at 14, ...): nn.TransformerEncoderLayer's fast path in eval
    src, embed, heads, ffn_w1 = args[0], args[1], args[2], args[14]
    rows, batch, length = _rows(src), (src.shape[0] if src.dim() == 3 else 1), src.shape[-2]
    flops, macs = _attention_block(rows, rows, batch, length, length, embed, heads)
    hidden = ffn_w1.shape[0]
    ffn = 2 * rows * embed * hidden
    # the feed-forward products and biases, its activation, two layer norms
    # (5 per element + weight + bias) and two residual adds
    flops += 2 * ffn + rows * (hidden + embed) + rows * hidden + 2 * 7 * rows * embed \
        + 2 * rows * embed
    return flops, macs + ffn


_RULES: dict[Any, Callable[[tuple, dict, Any], Cost]] = {
    aten.convolution.default: _convolution,
    aten._convolution.default: _convolution,
    aten.convolution_backward.default: _convolution_backward,
    aten._softmax.default: _per_element(5),
    aten._log_softmax.default: _per_element(5),
    aten._softmax_backward_data.default: _per_element(3),
    aten._log_softmax_backward_data.default: _per_element(3),
    aten.native_layer_norm.default: _norm(2, 3),
    aten.native_layer_norm_backward.default: _norm(5, 6, factor=2),
    aten.native_group_norm.default: _norm(1, 2),
    aten.native_batch_norm.default: _norm(1, 2),
    aten._native_batch_norm_legit.default: _norm(1, 2),
    aten._native_batch_norm_legit_no_training.default: _norm(1, 2),
    aten.native_dropout.default: _per_element(1),
}


def _optional(name: str, rule: Callable[[tuple, dict, Any], Cost]) -> None:
    """Ops that only some torch builds have."""
    packet = getattr(aten, name, None)
    if packet is not None:
        for overload in packet.overloads():
            _RULES[getattr(packet, overload)] = rule


# Every overload (``.default``, ``.out``) and the in-place forms: the
# operands sit at the same positions in all of them.
for _name in ("mm", "bmm", "mv"):
    _optional(_name, _product(0, 1))
for _name in ("addmm", "addmm_", "baddbmm", "baddbmm_", "addbmm", "addbmm_", "addmv", "addmv_"):
    _optional(_name, _product(1, 2, adds_input=True))
for _name in ("dot", "vdot"):
    _optional(_name, _dot)
for _name in ("addr", "addr_"):
    _optional(_name, _outer_product)
_optional("_addmm_activation", _addmm_activation)
_optional("_trilinear", _trilinear)
for _name in ("_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
              "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu",
              "_flash_attention_forward", "_efficient_attention_forward"):
    _optional(_name, _attention)
for _name in ("_scaled_dot_product_flash_attention_backward",
              "_scaled_dot_product_efficient_attention_backward",
              "_scaled_dot_product_cudnn_attention_backward",
              "_scaled_dot_product_flash_attention_for_cpu_backward"):
    _optional(_name, _attention_backward)
for _name in ("cudnn_convolution", "mkldnn_convolution", "miopen_convolution"):
    _optional(_name, _conv_impl)
_optional("mkldnn_rnn_layer", _rnn_layer)
_optional("mkldnn_rnn_layer_backward", _rnn_layer_backward)
_optional("_native_multi_head_attention", _native_mha)
_optional("_transformer_encoder_layer_fwd", _encoder_layer)
_optional("_fused_rms_norm", _rms_norm)
_optional("rms_norm", _rms_norm)


def _pooled(args: tuple, kwargs: dict, out: Any) -> Cost:
    """Pooling: one flop per element of the pooled input (DeepSpeed's
    ``_pool_flops_compute``)."""
    return _per_element(1)(args, kwargs, out)


def _input_gradient(args: tuple, kwargs: dict, out: Any) -> Cost:
    """A pooling backward: one flop per element of the input's gradient."""
    result = _first_tensor(out)
    return (result.numel(), 0) if result is not None else _NONE


_SCALES = ("scales", "scales_d", "scales_h", "scales_w", "scale_factors")


def upsample_flops(numel: int, output_size: Optional[Sequence[int]],
                   scales: Sequence[float]) -> int:
    """DeepSpeed's ``_upsample_flops_compute`` from what aten receives: with
    scale factors, ``numel`` (the input's) times their product (one factor
    raised to the number of spatial dimensions when they are all equal, as
    for DeepSpeed's scalar ``scale_factor``); otherwise the product of the
    output's spatial sizes."""
    if scales:
        factor = scales[0] ** len(scales) if len(set(scales)) == 1 else math.prod(scales)
        return int(numel * factor)
    return _numel(output_size or ())


def _upsample(names: Sequence[str]) -> Callable[[tuple, dict, Any], Cost]:
    """An ``upsample_*`` overload whose schema's argument names are ``names``
    (the scales sit at different positions in each mode's op)."""
    def rule(args: tuple, kwargs: dict, out: Any) -> Cost:
        bound = {**dict(zip(names, args)), **kwargs}
        scales: list[float] = []
        for name in _SCALES:
            value = bound.get(name)
            if isinstance(value, (list, tuple)):
                scales.extend(float(v) for v in value)
            elif value is not None:
                scales.append(float(value))
        x = args[0]
        return upsample_flops(x.numel(), bound.get("output_size"), scales), 0
    return rule


for _name in ("max_pool1d", "max_pool2d", "max_pool3d", "max_pool1d_with_indices",
              "max_pool2d_with_indices", "max_pool3d_with_indices", "avg_pool1d", "avg_pool2d",
              "avg_pool3d", "adaptive_avg_pool1d", "adaptive_avg_pool2d", "adaptive_avg_pool3d",
              "_adaptive_avg_pool2d", "_adaptive_avg_pool3d", "adaptive_max_pool1d",
              "adaptive_max_pool2d", "adaptive_max_pool3d", "mkldnn_max_pool2d",
              "mkldnn_max_pool3d", "mkldnn_adaptive_avg_pool2d"):
    _optional(_name, _pooled)
for _name in ("max_pool2d_with_indices_backward", "max_pool3d_with_indices_backward",
              "avg_pool2d_backward", "avg_pool3d_backward", "_adaptive_avg_pool2d_backward",
              "_adaptive_avg_pool3d_backward", "adaptive_max_pool2d_backward",
              "adaptive_max_pool3d_backward", "mkldnn_max_pool2d_backward",
              "mkldnn_max_pool3d_backward", "mkldnn_adaptive_avg_pool2d_backward"):
    _optional(_name, _input_gradient)
for _name in ("upsample_nearest1d", "upsample_nearest2d", "upsample_nearest3d",
              "upsample_linear1d", "upsample_bilinear2d", "upsample_bicubic2d",
              "upsample_trilinear3d", "_upsample_nearest_exact1d", "_upsample_nearest_exact2d",
              "_upsample_nearest_exact3d", "_upsample_bilinear2d_aa", "_upsample_bicubic2d_aa",
              "_upsample_lanczos2d_aa"):
    _packet = getattr(aten, _name, None)
    for _overload in (_packet.overloads() if _packet is not None else ()):
        _op = getattr(_packet, _overload)
        _RULES[_op] = _upsample([a.name for a in _op._schema.arguments])
    # the backward sums the output's gradient into the input's: one add per element
    _optional(_name + "_backward", _per_element(1))

# Pointwise in torch's tags, yet they only copy, select or fill.
_DATA_MOVEMENT = frozenset({"clone", "where", "masked_fill", "masked_fill_", "fill", "fill_",
                            "copy", "copy_", "lift_fresh_copy", "zeros_like", "ones_like",
                            "full_like", "empty_like", "_to_copy", "alias_copy"})

_POINTWISE = torch.Tag.pointwise
_REDUCTION = torch.Tag.reduction


def op_cost(func: Any, args: tuple, kwargs: Optional[dict], out: Any) -> Cost:
    """``(flops, macs)`` of one call of the aten op ``func`` (an
    ``OpOverload``) with these arguments and this output."""
    kwargs = kwargs or {}
    rule = _RULES.get(func)
    if rule is not None:
        return rule(args, kwargs, out)
    tags = getattr(func, "tags", ())
    if _POINTWISE in tags:
        if func._opname in _DATA_MOVEMENT:
            return _NONE
        result = _first_tensor(out)
        if result is None or not (result.is_floating_point() or result.is_complex()):
            # integer and boolean results (comparisons, masks) are not flops
            return _NONE
        return result.numel(), 0
    if _REDUCTION in tags:
        source = _first_tensor(args)
        if source is None or not (source.is_floating_point() or source.is_complex()):
            return _NONE
        return source.numel(), 0
    return _NONE
