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
least (DeepSpeed's dynamic programme, ties going to the later cut; the
one :mod:`dsrun.runtime.pipe.partition` cuts pipelines with, except its
``"flops"`` method, which minimises the heaviest stage first).

Also DeepSpeed's, with its results: ``noop_decorator(func)`` (``func``
itself); ``ensure_directory_exists(filename)`` (makes the file's
directory); ``copy_to_device(item, device, criterion_func)`` (copies of
the values ``criterion_func`` accepts, through lists, tuples and dicts,
other values as they are); ``call_to_str(base, *args, **kwargs)``
(``"base(1, x='a')"``); ``get_only_unique_item(items)`` (the one distinct
item, else RuntimeError); ``prefix_sum_inc(weights)``;
``align_dense_tensors(tensors, alignment)`` (a zero tensor appended so the
elements add up to a multiple of ``alignment``); ``get_tensor_bytes(item)``
(bytes of the tensors in nested containers); ``filter_empty_parameters``
and ``is_optimized_parameter`` (parameters with no elements left out);
``memory_status(msg, print_rank=-1, reset_max=False)`` (prints allocated
and cached memory with the change since its last call),
``get_ma_status()``, ``torch_memory_reserved()`` and
``torch_max_memory_reserved()`` (the accelerator's). The norm helpers
(``get_weight_norm``, ``get_grad_zeros``, ``get_flattened_grad_norm``,
``get_global_norm_of_tensors``, ``clip_tensors_by_global_norm``, ...) are
:mod:`dsrun.runtime.norms`; ``PartitionedTensor`` is
:mod:`dsrun.runtime.partitioned_tensor`.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import math
import os
import random
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Optional, Union

import torch
import torch.distributed as dist

from dsrun.runtime.dataloader import RepeatingLoader
from dsrun.runtime.norms import (
    CLIP_EPS,
    clip_tensors_by_global_norm,
    combine_grad_norm_groups,
    get_flattened_grad_norm,
    get_global_norm_of_tensors,
    get_grad_zeros,
    get_weight_norm,
    has_inf_or_nan,
    is_invalid_grad_norm,
    is_model_parallel_parameter,
    mask_nan_or_inf_with_val_inplace,
    reduce_model_parallel,
)
from dsrun.runtime.partitioned_tensor import PartitionedTensor
from dsrun.runtime.progress import LOGGER_NAME, ensure_visible, memory_line

__all__ = ["DummyOptim", "PartitionedTensor", "RepeatingLoader", "align_dense_tensors",
           "call_to_str", "clip_grad_norm_", "clip_tensors_by_global_norm",
           "combine_grad_norm_groups", "copy_to_device", "empty_cache",
           "ensure_directory_exists", "filter_empty_parameters", "get_flattened_grad_norm",
           "get_global_norm", "get_global_norm_of_tensors", "get_grad_zeros", "get_ma_status",
           "get_only_unique_item", "get_tensor_bytes", "get_weight_norm", "has_inf_or_nan",
           "is_invalid_grad_norm", "is_model_parallel_parameter", "is_optimized_parameter",
           "mask_nan_or_inf_with_val_inplace", "memory_status", "move_to_device",
           "noop_context", "noop_decorator", "partition_balanced", "partition_uniform",
           "prefix_sum_inc", "see_memory_usage", "set_random_seed", "torch_max_memory_reserved",
           "torch_memory_reserved"]

log = logging.getLogger(LOGGER_NAME)


def see_memory_usage(message: str, force: bool = False) -> None:
    if not force:
        return
    if dist.is_available() and dist.is_initialized() and dist.get_rank() != 0:
        return
    ensure_visible()
    log.info("%s | %s", message, memory_line())


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
    if norm_type == math.inf:
        total = torch.stack([g.detach().abs().max().float() for g in grads]).max() if grads \
            else torch.zeros((), device=device)
        reduce_model_parallel(total, mpu, True)
    else:
        replicated_counts = mpu is None or mpu.get_model_parallel_rank() == 0
        counted = [p.grad for p in params if p.grad is not None and (
            replicated_counts or is_model_parallel_parameter(p))]
        total = torch.zeros((), device=device)
        if counted:
            norms = torch.stack([torch.linalg.vector_norm(g.detach().float(), norm_type)
                                 for g in counted])
            total = norms.pow(norm_type).sum()
        reduce_model_parallel(total, mpu, False)
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
    def leaf(value: Any) -> Any:
        if criterion_func is not None and criterion_func(value):
            value.data = value.to(device).data
            return value
        return value.to(device)

    return map_nested(item, leaf, stop=criterion_func)


def map_nested(item: Any, leaf: Callable[[Any], Any],
               stop: Optional[Callable[[Any], bool]] = None) -> Any:
    """``item`` with ``leaf`` applied to each value inside its lists, tuples
    and dicts (rebuilt, of the same kinds); a value ``stop`` accepts is a
    leaf even if it is a container."""
    if stop is not None and stop(item):
        return leaf(item)
    if isinstance(item, list):
        return [map_nested(v, leaf, stop) for v in item]
    if isinstance(item, tuple):
        return tuple(map_nested(v, leaf, stop) for v in item)
    if isinstance(item, dict):
        return {k: map_nested(v, leaf, stop) for k, v in item.items()}
    return leaf(item)


def partition_uniform(num_items: int, num_parts: int) -> list[int]:
    """``num_parts + 1`` boundaries of equal parts (module docstring)."""
    from dsrun.runtime.pipe.partition import uniform_bounds

    return list(uniform_bounds(num_items, num_parts))


def partition_balanced(weights: Sequence[float], num_parts: int) -> list[int]:
    """``num_parts + 1`` boundaries of contiguous parts of ``weights`` whose
    largest and smallest sums differ the least (module docstring)."""
    if len(weights) <= num_parts:
        return partition_uniform(len(weights), num_parts)
    from dsrun.runtime.pipe.partition import least_spread

    return list(least_spread(weights, num_parts))


# ------------------------------------------------------------ small helpers


def noop_decorator(func: Callable[..., Any]) -> Callable[..., Any]:
    """``func`` itself (DeepSpeed's stand-in where a decorator is optional)."""
    return func


def ensure_directory_exists(filename: str) -> None:
    """Make the directory that ``filename`` is to be written in (and its parents)."""
    os.makedirs(os.path.dirname(filename), exist_ok=True)


def copy_to_device(item: Any, device: Any, criterion_func: Callable[[Any], bool]) -> Any:
    """``item`` with copies on ``device`` of the values ``criterion_func``
    accepts, through lists, tuples and dicts; other values as they are."""
    return map_nested(item, lambda v: v.to(device) if criterion_func(v) else v,
                      stop=criterion_func)


def call_to_str(base: str, *args: Any, **kwargs: Any) -> str:
    """``base(*args, **kwargs)`` as text, the arguments by ``repr``."""
    parts = [repr(arg) for arg in args] + [f"{key}={value!r}" for key, value in kwargs.items()]
    return f"{base}({', '.join(parts)})"


def get_only_unique_item(items: Iterable[Any]) -> Any:
    """The one distinct value of ``items``; RuntimeError when there are none or several."""
    items = list(items)
    distinct = set(items)
    if len(distinct) != 1:
        raise RuntimeError(f"expected there to be only one unique element in {items}")
    return next(iter(distinct))


def prefix_sum_inc(weights: Iterable[Any]) -> list[Any]:
    """The inclusive prefix sums of ``weights``: ``[3, 4, 5]`` -> ``[3, 7, 12]``."""
    return list(itertools.accumulate(weights))


def align_dense_tensors(tensor_list: list[torch.Tensor], alignment: int) -> list[torch.Tensor]:
    """``tensor_list``, with a zero tensor (the first's dtype and device)
    appended when its elements do not add up to a multiple of ``alignment``."""
    remaining = sum(t.numel() for t in tensor_list) % alignment
    if not remaining:
        return tensor_list
    first = tensor_list[0]
    return [*tensor_list, torch.zeros(alignment - remaining, device=first.device,
                                      dtype=first.dtype)]


def get_tensor_bytes(item: Any) -> int:
    """The bytes of the tensors in ``item``, through lists, tuples and dicts."""
    if torch.is_tensor(item):
        return item.numel() * item.element_size()
    if isinstance(item, (list, tuple)):
        return sum(get_tensor_bytes(v) for v in item)
    if isinstance(item, dict):
        return sum(get_tensor_bytes(v) for v in item.values())
    return 0


def filter_empty_parameters(params: Any) -> Any:
    """``params`` (parameters, or param-group dicts) without the parameters
    that have no elements; a group left with none is dropped."""
    if not isinstance(params, (list, tuple)) or not params:
        return params
    if not isinstance(params[0], dict):
        return [p for p in params if p.numel() > 0]
    groups = []
    for group in params:
        kept = [p for p in group.get("params", []) if p.numel() > 0]
        if kept:
            groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": kept})
    return groups


def is_optimized_parameter(param: Any) -> bool:
    """Whether an optimizer should own ``param``: it requires grad and has
    elements (its ZeRO-3 element count where it is partitioned)."""
    numel = param.ds_numel if hasattr(param, "ds_numel") else param.numel()
    return bool(param.requires_grad) and numel > 0


# ------------------------------------------------------------ memory


def torch_memory_reserved(device_index: Any = None) -> int:
    """The accelerator's reserved memory (DeepSpeed binds the method at import)."""
    from dsrun.accelerator import get_accelerator

    return get_accelerator().memory_reserved(device_index)


def torch_max_memory_reserved(device_index: Any = None) -> int:
    from dsrun.accelerator import get_accelerator

    return get_accelerator().max_memory_reserved(device_index)


# what memory_status saw last, to print the change (per process, as DeepSpeed)
_last_seen = {"allocated": 0, "cached": 0}


def memory_status(msg: str, print_rank: int = -1, reset_max: bool = False) -> None:
    """Print this rank's allocated and cached memory, their change since the
    last call and their peaks, in GB (``print_rank``: only that rank prints;
    ``reset_max`` resets the peaks first)."""
    from dsrun import comm
    from dsrun.accelerator import get_accelerator

    rank = comm.get_rank()
    if print_rank != -1 and rank != print_rank:
        return
    acc = get_accelerator()
    acc.synchronize()
    if reset_max:
        acc.reset_max_memory_cached()
        acc.reset_max_memory_allocated()
    allocated, cached = acc.memory_allocated(), acc.memory_cached()
    d_alloc, d_cached = allocated - _last_seen["allocated"], cached - _last_seen["cached"]
    _last_seen.update(allocated=allocated, cached=cached)
    gb = 1024 ** 3
    print(f"RANK={rank} MEMSTATS", msg, f"device={acc.current_device_name()} "
          f"current alloc={allocated / gb:0.4f}GB (delta={d_alloc / gb:0.4f}GB "
          f"max={acc.max_memory_allocated() / gb:0.4f}GB) "
          f"current cache={cached / gb:0.4f}GB (delta={d_cached / gb:0.4f}GB "
          f"max={acc.max_memory_cached() / gb:0.4f}GB)")


def get_ma_status() -> int:
    """The accelerator's allocated memory on global rank 0; 0 on other ranks."""
    from dsrun import comm
    from dsrun.accelerator import get_accelerator

    if comm.is_initialized() and comm.get_rank() != 0:
        return 0
    return get_accelerator().memory_allocated()
