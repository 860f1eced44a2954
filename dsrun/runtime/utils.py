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
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable
from typing import Any, Union

import torch
import torch.distributed as dist

from dsrun.runtime.dataloader import RepeatingLoader
from dsrun.runtime.progress import LOGGER_NAME, ensure_visible, memory_line
from dsrun.runtime.zero.masters import CLIP_EPS

__all__ = ["DummyOptim", "RepeatingLoader",
           "clip_grad_norm_", "empty_cache", "get_global_norm", "see_memory_usage"]

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
