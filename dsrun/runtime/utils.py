"""DeepSpeed's ``deepspeed.runtime.utils`` helpers that training scripts call.

``see_memory_usage(message, force=False)``: with ``force=True``, global
rank 0 logs ``message`` and this process's memory (CUDA allocated and
reserved with their peaks where CUDA is in use, the host resident set and
its peak, the machine's memory in use); without it, nothing - as in
DeepSpeed, where scripts leave the calls in and switch them with ``force``.

``clip_grad_norm_(parameters, max_norm, norm_type=2, mpu=None)`` clips as
``torch.nn.utils.clip_grad_norm_`` does and returns the total norm; with an
``mpu`` the norm is over the whole model-parallel model: parameters marked
``model_parallel`` / ``tensor_model_parallel`` (split across the group)
count on every model-parallel rank, the others (replicated) on its rank 0
only, and the partial norms are reduced over
``mpu.get_model_parallel_group()`` (max for ``inf``). DeepSpeed also
averages the result over its data-parallel group for MoE; dsrun has no MoE
and the norm is the same on every data-parallel rank, so it does not.
``get_global_norm(norm_list)`` is the 2-norm of a list of norms (``inf``
when one is not finite or negative). ``empty_cache()`` releases the
accelerator's cached memory and resets its peak statistics. ``DummyOptim
(params)`` is DeepSpeed's stand-in with one param group holding ``params``.

``RepeatingLoader`` is :class:`dsrun.runtime.dataloader.RepeatingLoader`.

Small pure helpers scripts import from here, with DeepSpeed's results:
``set_random_seed(seed)`` seeds ``random``, numpy (modulo 2**32, where
numpy is installed) and torch (modulo 2**63); ``noop_context()`` is a
context manager that does nothing; ``move_to_device(item, device,
criterion_func=None)`` moves tensors nested in lists, tuples and dicts
(those ``criterion_func`` accepts in place, through ``.data``);
``partition_uniform(num_items, num_parts)`` and
``partition_balanced(weights, num_parts)`` give ``num_parts + 1``
boundaries as DeepSpeed's do: equal counts (the first ``num_items %
num_parts`` parts one more; empty parts when there are fewer items than
parts), and contiguous parts whose heaviest and lightest part differ the
least (DeepSpeed's dynamic programme, ties going to the later cut).
:mod:`dsrun.runtime.pipe.partition` is dsrun's own pipeline partitioning,
which minimises the heaviest stage instead.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import math
import random
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Optional, Union

import torch
import torch.distributed as dist

from dsrun.runtime.dataloader import RepeatingLoader
from dsrun.runtime.progress import LOGGER_NAME, ensure_visible, memory_line
from dsrun.runtime.zero.masters import CLIP_EPS

__all__ = ["DummyOptim", "RepeatingLoader", "clip_grad_norm_", "empty_cache",
           "get_global_norm", "move_to_device", "noop_context", "partition_balanced",
           "partition_uniform", "see_memory_usage", "set_random_seed"]

log = logging.getLogger(LOGGER_NAME)


def see_memory_usage(message: str, force: bool = False) -> None:
    if not force:
        return
    if dist.is_available() and dist.is_initialized() and dist.get_rank() != 0:
        return
    ensure_visible()
    log.info("%s | %s", message, memory_line())


def _split_across_model_parallel(param: torch.Tensor) -> bool:
    return bool(getattr(param, "model_parallel", False)
                or getattr(param, "tensor_model_parallel", False))


def clip_grad_norm_(parameters: Union[torch.Tensor, Iterable[torch.Tensor]], max_norm: float,
                    norm_type: float = 2, mpu: Any = None) -> torch.Tensor:
    """Scale gradients in place so their total norm is at most ``max_norm``;
    returns the total norm before clipping (module docstring)."""
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    grads = [p.grad for p in params if p.grad is not None]
    if not grads and mpu is None:
        return torch.zeros(())
    # a rank without gradients still joins its model-parallel group's reduction
    device = (grads or params)[0].device if grads or params else torch.device("cpu")
    norm_type = float(norm_type)
    group = None if mpu is None else mpu.get_model_parallel_group()
    if norm_type == math.inf:
        total = torch.stack([g.detach().abs().max().float() for g in grads]).max() if grads \
            else torch.zeros((), device=device)
        if group is not None:
            dist.all_reduce(total, op=dist.ReduceOp.MAX, group=group)
    else:
        replicated_counts = mpu is None or mpu.get_model_parallel_rank() == 0
        counted = [p.grad for p in params if p.grad is not None and (
            replicated_counts or _split_across_model_parallel(p))]
        total = torch.zeros((), device=device)
        if counted:
            norms = torch.stack([torch.linalg.vector_norm(g.detach().float(), norm_type)
                                 for g in counted])
            total = norms.pow(norm_type).sum()
        if group is not None:
            dist.all_reduce(total, group=group)
        total = total.pow(1.0 / norm_type)
    coef = torch.clamp(float(max_norm) / (total + CLIP_EPS), max=1.0)
    for grad in grads:
        grad.detach().mul_(coef.to(grad.device, grad.dtype))
    return total


def get_global_norm(norm_list: Iterable[Any]) -> float:
    """The 2-norm of per-part norms; ``inf`` when one is not finite or negative."""
    norms = [float(n) for n in norm_list]
    if any(not math.isfinite(n) or n < 0 for n in norms):
        return math.inf
    return math.sqrt(sum(n * n for n in norms))


def empty_cache() -> None:
    """Release the accelerator's cached memory and reset its peak memory statistics."""
    from dsrun.accelerator import get_accelerator

    accelerator = get_accelerator()
    accelerator.empty_cache()
    accelerator.reset_peak_memory_stats()


class DummyOptim:
    """DeepSpeed's placeholder optimizer: ``param_groups`` is ``[{"params": params}]``."""

    def __init__(self, params: Any) -> None:
        self.param_groups: list[dict[str, Any]] = [{"params": params}]


#: DeepSpeed's do-nothing context manager (``with noop_context(): ...``).
noop_context = contextlib.nullcontext


def set_random_seed(seed: int) -> None:
    """Seed ``random``, numpy and torch's generators (module docstring)."""
    random.seed(seed)
    try:
        import numpy
    except ImportError:
        pass
    else:
        numpy.random.seed(seed % 2**32)  # numpy takes 32-bit seeds only
    torch.manual_seed(seed % 2**63)


def move_to_device(item: Any, device: Any,
                   criterion_func: Optional[Callable[[Any], bool]] = None) -> Any:
    """``item`` with its tensors on ``device``, through lists, tuples and
    dicts. A value ``criterion_func`` accepts is moved in place (its
    ``.data`` replaced, so references to it see the move) and returned; any
    other leaf is ``leaf.to(device)``, as in DeepSpeed."""
    if criterion_func is not None and criterion_func(item):
        item.data = item.to(device).data
        return item
    if isinstance(item, list):
        return [move_to_device(v, device, criterion_func) for v in item]
    if isinstance(item, tuple):
        return tuple(move_to_device(v, device, criterion_func) for v in item)
    if isinstance(item, dict):
        return {k: move_to_device(v, device, criterion_func) for k, v in item.items()}
    return item.to(device)


def partition_uniform(num_items: int, num_parts: int) -> list[int]:
    """``num_parts + 1`` boundaries of equal parts (module docstring)."""
    size, extra = divmod(num_items, num_parts)
    return [p * size + min(p, extra) for p in range(num_parts + 1)]


def partition_balanced(weights: Sequence[float], num_parts: int) -> list[int]:
    """``num_parts + 1`` boundaries of contiguous parts of ``weights`` whose
    largest and smallest sums differ the least (module docstring)."""
    n, m = len(weights), num_parts
    if n <= m:
        return partition_uniform(n, m)
    prefix = [0, *itertools.accumulate(weights)]
    # for the first i items in j parts: the least spread found, the largest
    # and smallest part sums that give it, and where its last part starts
    spread = [[math.inf] * (m + 1) for _ in range(n + 1)]
    most = [[math.inf] * (m + 1) for _ in range(n + 1)]
    least = [[math.inf] * (m + 1) for _ in range(n + 1)]
    start = [[0] * (m + 1) for _ in range(n + 1)]
    spread[0][0] = most[0][0] = 0
    for i in range(1, n + 1):
        for j in range(1, min(i, m) + 1):
            for k in range(i):
                part = prefix[i] - prefix[k]
                hi, lo = max(most[k][j - 1], part), min(least[k][j - 1], part)
                if spread[i][j] >= hi - lo:  # ">=": the later cut wins ties
                    spread[i][j], most[i][j], least[i][j], start[i][j] = hi - lo, hi, lo, k
    bounds = [n]
    for j in range(m, 0, -1):
        bounds.append(start[bounds[-1]][j])
    return bounds[::-1]
