"""Model-state memory per rank: the ZeRO paper's formulas, and the bytes a
rank actually holds.

**Formulas** (Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward
Training Trillion Parameter Models", section 5.1): with Ψ parameters, N
data-parallel ranks, and K bytes of optimizer state per parameter (12 for
mixed-precision Adam: fp32 master weights, momentum and variance), one rank
holds in mixed precision (2-byte parameters and gradients)::

    DP (stage 0)   (2 + 2 + K) Ψ
    stage 1 (Pos)  2Ψ + 2Ψ + KΨ/N
    stage 2 (Pos+g) 2Ψ + (2 + K)Ψ/N
    stage 3 (Pos+g+p) (2 + 2 + K)Ψ/N

In fp32 the 2-byte parameters and gradients become 4 bytes. K is whatever
the optimizer keeps: 12 for Adam with a separate fp32 master copy - which
dsrun's ZeRO stages keep also in fp32 (a flat fp32 partition the inner
optimizer steps on) - and 8 for plain fp32 Adam stepping the model's own
parameters (stage 0 in fp32).

**Counting**: :func:`count_bytes` walks tensors by category and counts each
underlying storage once (keyed by device and data pointer, the first
category that reaches a storage keeps it), so views, shared parameters and
gradients that are views into a bucket are not counted twice. A sparse
tensor (the gradient of ``nn.Embedding(sparse=True)``) counts as its
indices and values.
:func:`model_state_bytes` applies it to model parameters and an optimizer
(a torch optimizer or anything with an ``.optimizer`` attribute holding one,
such as :class:`~dsrun.runtime.zero.sharded.ZeroOptimizer`).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

PRECISION_BYTES: Mapping[str, int] = {"mixed": 2, "fp32": 4}


def zero_model_state_bytes(psi: int, world_size: int, stage: int, *, param_bytes: float = 2,
                           grad_bytes: float = 2, optimizer_bytes: float = 12) -> float:
    """Bytes of model state per rank at ``stage`` (module docstring), for
    ``psi`` parameters on ``world_size`` ranks."""
    if psi < 0 or world_size < 1 or stage not in (0, 1, 2, 3):
        raise ValueError(f"need psi >= 0, world_size >= 1, stage 0-3; got {psi}, "
                         f"{world_size}, {stage}")
    p, g, k, n = param_bytes * psi, grad_bytes * psi, optimizer_bytes * psi, world_size
    return {0: p + g + k, 1: p + g + k / n, 2: p + (g + k) / n, 3: (p + g + k) / n}[stage]


def paper_model_state_bytes(psi: int, world_size: int, stage: int, *,
                            precision: str = "mixed", k: float = 12) -> float:
    """The paper's formula with 2-byte (``"mixed"``) or 4-byte (``"fp32"``)
    parameters and gradients and K = ``k``."""
    if precision not in PRECISION_BYTES:
        raise ValueError(f"precision {precision!r}; valid: {', '.join(PRECISION_BYTES)}")
    size = PRECISION_BYTES[precision]
    return zero_model_state_bytes(psi, world_size, stage, param_bytes=size, grad_bytes=size,
                                  optimizer_bytes=k)


@dataclass(frozen=True)
class StateBytes:
    """Bytes one rank holds, by category; ``buffers`` (communication
    scratch) is not model state and not in :attr:`model_state`."""

    params: int = 0
    grads: int = 0
    optimizer: int = 0
    buffers: int = 0
    host: int = 0  # of the model state, bytes in host (CPU) memory

    @property
    def model_state(self) -> int:
        return self.params + self.grads + self.optimizer


def tensors_in(value: Any) -> Iterator[torch.Tensor]:
    """Every tensor inside nested dicts, lists and tuples."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, Mapping):
        for item in value.values():
            yield from tensors_in(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from tensors_in(item)


def count_bytes(*, params: Iterable[torch.Tensor] = (), grads: Iterable[torch.Tensor] = (),
                optimizer: Iterable[torch.Tensor] = (),
                buffers: Iterable[torch.Tensor] = ()) -> StateBytes:
    """Storage bytes per category, each storage counted once (first
    category wins, in the order params, grads, optimizer, buffers)."""
    seen: set[tuple[str, int]] = set()
    totals: list[int] = []
    host = 0
    for category, tensors in enumerate((params, grads, optimizer, buffers)):
        total = 0
        for tensor in _dense_parts(tensors):
            storage = tensor.untyped_storage()
            key = (str(tensor.device), storage.data_ptr())
            if storage.nbytes() == 0 or key in seen:
                continue
            seen.add(key)
            total += storage.nbytes()
            if category < 3 and tensor.device.type == "cpu":
                host += storage.nbytes()
        totals.append(total)
    return StateBytes(*totals, host=host)


def _dense_parts(tensors: Iterable[torch.Tensor]) -> Iterator[torch.Tensor]:
    """``tensors``, a sparse COO one as its indices and values (it has no
    storage of its own); other sparse layouts are not counted."""
    for tensor in tensors:
        if tensor.layout == torch.sparse_coo:
            yield tensor._indices()
            yield tensor._values()
        elif tensor.layout == torch.strided:
            yield tensor


def model_state_bytes(params: Iterable[torch.Tensor], optimizer: Any = None,
                      buffers: Iterable[torch.Tensor] = ()) -> StateBytes:
    """What one rank holds for ``params`` (the model's, with their ``.grad``)
    and ``optimizer`` (its parameters - master copies - their gradients, and
    its state), plus ``buffers``."""
    params = list(params)
    inner = getattr(optimizer, "optimizer", optimizer)
    stepped = [p for g in inner.param_groups for p in g["params"]] if inner is not None else []
    grads = [t.grad for t in [*params, *stepped] if t.grad is not None]
    state = [t for s in inner.state.values() for t in tensors_in(s)] if inner is not None else []
    return count_bytes(params=params, grads=grads, optimizer=[*stepped, *state],
                       buffers=buffers)
