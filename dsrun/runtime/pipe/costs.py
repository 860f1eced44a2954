"""What each pipeline layer costs to train, for ``partition_method="flops"``.

Balancing parameters (``"parameters"``) or layer counts (``"uniform"``,
``"type:REGEX"``) balances memory or structure, not time: an output
projection onto a large vocabulary has the embedding's parameters but far
more work, and a convolution has few parameters and much work. The
``"flops"`` method weighs every layer by the floating-point operations of
its forward and backward pass on one micro-batch shaped like
``example_inputs``, and balances those.

How it counts, without allocating the model: every layer is built on
torch's ``meta`` device (a module given as an instance runs with meta
stand-ins of its parameters and buffers), then run forward and backward on
meta tensors of the example's shapes and dtypes, the first layer on the
example itself and each later one on its predecessor's output, the last
one followed by ``loss_fn(outputs, example_labels)`` when both are given.
Every aten op is priced by :func:`dsrun.profiling.counting.op_cost` (the
flops profiler's rules). Meta tensors have shapes but no data, so nothing is
computed and the count is the same on every rank: the partition needs no
communication. Under activation checkpointing
(``activation_checkpoint_interval > 0``) a checkpointed layer's forward runs
twice, so it is counted twice.

Flops are a cost model, not a timing: memory-bound ops (norms, softmax,
pointwise) cost more per flop than matrix products, so a partition of
layers whose mix of the two differs much is balanced less well than one of
similar layers. A layer that cannot run on the meta device (data-dependent
Python control flow such as ``.item()``, custom kernels without a meta
implementation) is an error naming it; explicit boundaries are the way out
there.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any, Callable, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from dsrun.errors import DsrunConfigError
from dsrun.profiling.counting import op_cost
from dsrun.runtime.pipe.layers import LayerSpec, TiedLayerSpec, build_on_meta, layer_name
from dsrun.runtime.zero.memory import tensors_in

__all__ = ["layer_flops"]


class _FlopCount(TorchDispatchMode):
    """Sums the flops of every op dispatched while it is active."""

    def __init__(self) -> None:
        super().__init__()
        self.flops = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (),
                           kwargs: Optional[dict] = None) -> Any:
        out = func(*args, **(kwargs or {}))
        self.flops += op_cost(func, args, kwargs, out)[0]
        return out


def _meta_like(value: Any) -> Any:
    """Tensors (in tuples and lists too) as meta tensors of the same shape and
    dtype, without autograd history; anything else unchanged."""
    if isinstance(value, torch.Tensor):
        return torch.empty_like(value, device="meta")
    if isinstance(value, (tuple, list)):
        return type(value)(_meta_like(v) for v in value)
    return value


def _next_input(value: Any) -> Any:
    """A layer's output as the next layer's input: cut from the graph, and
    asking for its gradient where it had one (as a stage boundary does)."""
    if isinstance(value, torch.Tensor):
        return value.detach().requires_grad_(value.requires_grad)
    if isinstance(value, (tuple, list)):
        return type(value)(_next_input(v) for v in value)
    return value


def _meta_call(module: torch.nn.Module) -> Callable[[Any], Any]:
    """``module(x)`` with meta stand-ins for its parameters and buffers (the
    module itself is not touched)."""
    state = {name: torch.empty_like(t, device="meta").requires_grad_(t.requires_grad)
             for name, t in [*module.named_parameters(remove_duplicate=False),
                             *module.named_buffers(remove_duplicate=False)]}
    return lambda x: torch.func.functional_call(module, state, (x,))


def _runner(layer: Any, tied: dict[str, torch.nn.Module]) -> Callable[[Any], Any]:
    if isinstance(layer, TiedLayerSpec):
        if layer.key not in tied:
            tied[layer.key] = build_on_meta(layer)
        module = tied[layer.key]
        return functools.partial(layer.forward_fn, module) if layer.forward_fn else module
    if isinstance(layer, LayerSpec):
        return build_on_meta(layer)
    if isinstance(layer, torch.nn.Module):
        return _meta_call(layer)
    return layer


def _backward(value: Any) -> None:
    roots = [t for t in tensors_in(value) if t.requires_grad]
    if roots:
        torch.autograd.backward(roots, [torch.ones_like(t) for t in roots])


def layer_flops(layers: Sequence[Any], example_inputs: Any, *,
                example_labels: Any = None,
                loss_fn: Optional[Callable[[Any, Any], Any]] = None,
                recomputed: Optional[Sequence[bool]] = None) -> list[int]:
    """Forward + backward flops of each layer on one micro-batch shaped like
    ``example_inputs`` (module docstring). ``recomputed[i]``: layer ``i``'s
    forward runs again in the backward (activation checkpointing)."""
    if not any(True for _ in tensors_in(example_inputs)):
        raise DsrunConfigError("partition_method='flops' needs example_inputs=: a tensor (or "
                               "a tuple of tensors) shaped like one micro-batch's input to "
                               f"the first layer, got {type(example_inputs).__name__}")
    again = list(recomputed) if recomputed is not None else [False] * len(layers)
    tied: dict[str, torch.nn.Module] = {}
    costs = []
    x = _meta_like(example_inputs)
    labels = _meta_like(example_labels)
    last = len(layers) - 1
    for index, layer in enumerate(layers):
        counter = _FlopCount()
        try:
            with torch.device("meta"):
                run = _runner(layer, tied)
                with counter:
                    out = run(x)
                forward = counter.flops
                with counter:
                    target = loss_fn(out, labels) \
                        if index == last and loss_fn is not None and example_labels is not None \
                        else out
                    _backward(target)
        except DsrunConfigError:
            raise
        except Exception as exc:  # noqa: BLE001 - named with the layer below
            raise DsrunConfigError(
                f"partition_method='flops': layer {index} ({layer_name(layer)}) cannot run on "
                f"torch's meta device with the example inputs' shapes "
                f"({type(exc).__name__}: {exc}); give explicit boundaries or use another "
                "partition method") from None
        costs.append(counter.flops + (forward if again[index] else 0))
        x = _next_input(out)
    return costs
