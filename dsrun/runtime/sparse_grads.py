"""Sparse gradients: the weights of ``nn.Embedding(sparse=True)`` and
``nn.EmbeddingBag(sparse=True)``, whose ``.grad`` autograd makes a sparse
COO tensor (only the rows the batch looked up).

At ZeRO stage 0 they are averaged over the data-parallel group the way
DeepSpeed's engine does it (``sparse_allreduce``), not through the dense
buckets of :mod:`~dsrun.runtime.grad_sync` (a sparse tensor has no flat
view to copy into a bucket slot):

* coalesce this rank's gradient (rows summed once, indices sorted);
* cast its values to the communication dtype and multiply them by
  ``1/world_size``;
* all-gather the indices and the values of every rank (padded to the
  longest, as gloo's all-gather needs equal sizes; the lengths go first);
* hand back ``sparse_coo_tensor(cat(indices), cat(values))`` in the
  gradient's dtype, **uncoalesced** (rank 0's rows, then rank 1's, ...): the
  optimizer adds the contributions of a row shared by several ranks in that
  order, as with DeepSpeed, so results are bitwise DeepSpeed's.

At world size 1 the gradient is only coalesced (DeepSpeed goes through the
same path, where the gather is a copy). ZeRO stages 1-3 flatten gradients
into partitions and cannot take a sparse one (DeepSpeed fails there too):
:func:`refuse_at_zero` says so at ``initialize()``.

torch's ``clip_grad_norm_`` cannot take a sparse gradient either;
:func:`clip_grad_norm_` and :func:`grad_norm` can (a sparse gradient's norm
is that of its coalesced values, as ``Tensor.norm`` computes it, which
DeepSpeed's clipping uses); the fp32 step (:mod:`~dsrun.runtime.precision`)
clips with them and scales sparse gradients as dense ones (DeepSpeed's
clipping does not: it multiplies them by a one-element tensor, which has no
effect on a sparse tensor). The 16-bit precisions do not take sparse gradients yet:
:func:`refuse_in_16_bits` refuses them at ``initialize()``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Optional

import torch
import torch.distributed as dist

from dsrun import comm as collectives
from dsrun.errors import DsrunConfigError
from dsrun.runtime.norms import CLIP_EPS

# module classes whose ``sparse=True`` makes the weight's gradient sparse
SPARSE_GRAD_MODULES = (torch.nn.Embedding, torch.nn.EmbeddingBag)


def sparse_grad_params(module: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    """(name, parameter) of each weight of ``module`` whose gradient is
    sparse (an Embedding or EmbeddingBag built with ``sparse=True``), in
    ``named_parameters()`` order, each once."""
    sparse = {id(m.weight) for m in module.modules()
              if isinstance(m, SPARSE_GRAD_MODULES) and m.sparse
              and isinstance(getattr(m, "weight", None), torch.nn.Parameter)}
    return [(name, p) for name, p in module.named_parameters() if id(p) in sparse]


def refuse_at_zero(module: torch.nn.Module, stage: int, source: str) -> None:
    """ZeRO stages 1-3 cannot reduce sparse gradients: raise, naming the first
    parameter that would get one."""
    found = [name for name, p in sparse_grad_params(module) if p.requires_grad]
    if found:
        more = f" (and {len(found) - 1} more)" if len(found) > 1 else ""
        raise DsrunConfigError(
            f"parameter {found[0]!r}{more} gets sparse gradients (an nn.Embedding or "
            f"nn.EmbeddingBag built with sparse=True), which ZeRO stage {stage} ({source}) "
            "cannot partition (DeepSpeed fails there too): use ZeRO stage 0, where they are "
            "all-gathered sparsely, or build the embedding with sparse=False")


def grad_norm(grads: Sequence[torch.Tensor]) -> torch.Tensor:
    """L2 norm of all ``grads`` together, in fp32; a sparse one counts by its
    coalesced values."""
    if not grads:
        return torch.zeros(())
    norms = [torch.linalg.vector_norm(g.coalesce().values() if g.is_sparse else g,
                                      dtype=torch.float32) for g in grads]
    return torch.linalg.vector_norm(torch.stack(norms))


def clip_grad_norm_(params: Sequence[torch.Tensor], max_norm: float) -> torch.Tensor:
    """torch's ``clip_grad_norm_`` (the same call where every gradient is
    dense), also for sparse gradients: the total norm before clipping."""
    grads = [p.grad for p in params if p.grad is not None]
    if not any(g.is_sparse for g in grads):
        return torch.nn.utils.clip_grad_norm_(params, max_norm)
    total = grad_norm(grads)
    coefficient = torch.clamp(max_norm / (total + CLIP_EPS), max=1.0)
    with torch.no_grad():
        for g in grads:
            g.mul_(coefficient.to(g.dtype))
    return total


def refuse_in_16_bits(module: torch.nn.Module, precision: Any, source: str) -> None:
    """Stage 0: refuse sparse gradients under a 16-bit precision (fp16's
    master copies and loss scale, bf16's norm and overflow checks have not
    been made to take them); in fp32, clipping and the norm take them."""
    found = [name for name, p in sparse_grad_params(module) if p.requires_grad]
    if not found:
        return
    if not (precision.reports_norm or precision.skips_nonfinite or precision.scaler is not None):
        return
    raise DsrunConfigError(
        f"parameter {found[0]!r} gets sparse gradients (an nn.Embedding or nn.EmbeddingBag "
        f"built with sparse=True), which the {precision.name} step ({source}) does not take "
        "yet: train it in fp32 (gradient clipping works there), or build the embedding "
        "with sparse=False")


def sparse_mean(grad: Optional[torch.Tensor], like: torch.Tensor, *, group: Any,
                world_size: int, comm_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """The mean over ``group`` of every rank's sparse gradient of ``like``
    (module docstring); ``grad`` None counts as no rows; a dense ``grad``
    (set by hand) is made sparse first. Every rank must call this for the
    same parameters in the same order."""
    if grad is None:
        grad = torch.sparse_coo_tensor(torch.zeros(1, 0, dtype=torch.long, device=like.device),
                                       like.new_zeros((0, *like.shape[1:])), like.shape)
    elif not grad.is_sparse:
        grad = grad.to_sparse(sparse_dim=1)
    grad = grad.coalesce()
    if world_size == 1:
        return grad
    dtype = grad.dtype
    values = grad.values().to(comm_dtype or dtype)
    values = values.mul(1.0 / world_size)
    # (nnz, sparse_dim): both gathers then pad and cut along dimension 0
    indices = _gather_rows(grad.indices().t().contiguous(), group, world_size)
    gathered = _gather_rows(values, group, world_size)
    return torch.sparse_coo_tensor(indices.t(), gathered.to(dtype), grad.shape,
                                   check_invariants=False)


def _gather_rows(rows: torch.Tensor, group: Any, world_size: int) -> torch.Tensor:
    """Every rank's ``rows`` (lengths may differ) concatenated in rank order."""
    length = torch.tensor([rows.shape[0]], dtype=torch.long, device=rows.device)
    lengths = [torch.zeros_like(length) for _ in range(world_size)]
    collectives.all_gather(lengths, length, group=group)
    counts = [int(n) for n in lengths]
    longest = max(counts)
    padded = rows
    if rows.shape[0] < longest:
        padded = torch.cat([rows, rows.new_zeros((longest - rows.shape[0], *rows.shape[1:]))])
    parts = [torch.empty_like(padded) for _ in range(world_size)]
    collectives.all_gather(parts, padded, group=group)
    return torch.cat([part[:count] for part, count in zip(parts, counts)])


def reduce_sparse(params: Sequence[torch.nn.Parameter], *, group: Any,
                  comm_dtype: Optional[torch.dtype] = None) -> None:
    """Replace each parameter's ``.grad`` by :func:`sparse_mean` of it, in
    order; a frozen one without a gradient still takes part (every rank
    gathers the same tensors) and keeps ``.grad`` None."""
    world_size = dist.get_world_size(group)
    for param in params:
        reduced = sparse_mean(param.grad, param, group=group, world_size=world_size,
                              comm_dtype=comm_dtype)
        if param.grad is not None or param.requires_grad:
            param.grad = reduced
