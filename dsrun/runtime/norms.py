"""DeepSpeed's norm helpers of ``deepspeed.runtime.utils`` (re-exported by
:mod:`dsrun.runtime.utils`), for scripts and Megatron-style optimizers.

With an ``mpu`` (Megatron's model-parallel unit) the norms are over the
whole model-parallel model: the partial results are reduced over
``mpu.get_model_parallel_group()`` (a sum of p-th powers, a max for
``inf``). Where DeepSpeed counts a parameter once per model, so does dsrun:
:func:`get_weight_norm` and :func:`get_grad_zeros` skip parameters marked
``ds_pipe_replicated``, and, on tensor-model-parallel ranks other than 0,
the replicated ones (those not marked ``model_parallel`` /
``tensor_model_parallel``). :func:`get_flattened_grad_norm` counts every
parameter it is given, as DeepSpeed's does.

Results follow DeepSpeed 0.19.8: :func:`get_weight_norm` and
:func:`get_flattened_grad_norm` return a Python float, ``-1`` when the norm
is not finite; :func:`get_global_norm_of_tensors` a float32 scalar tensor,
``-1`` when not finite; :func:`get_grad_zeros` the count of zero gradient
elements as a float (sums in float64, where DeepSpeed's partial sums are
float32: results agree to float32's precision). The reductions run on the accelerator's device (what
the process group communicates on). dsrun has no expert (MoE) groups:
``moe_ep_group`` is reduced over when given without an ``mpu``.

The engine's own step uses the same rule where the mpu's model-parallel
size is above 1 (:func:`model_parallel_of`, :class:`ModelParallel`): stage 0
through :func:`clip_model_parallel_`, the ZeRO stages on their partitions
(:mod:`~dsrun.runtime.zero.masters`). A gradient that is not finite in a
parameter a rank does not count still makes its norm ``inf``
(:func:`split_squares`), so every tensor-parallel rank skips together.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Optional, Union

import torch

Tensors = Union[torch.Tensor, Iterable[torch.Tensor]]

__all__ = ["ModelParallel", "clip_model_parallel_", "clip_tensors_by_global_norm",
           "combine_grad_norm_groups", "get_flattened_grad_norm",
           "get_global_norm_of_tensors", "get_grad_zeros", "get_weight_norm", "has_inf_or_nan",
           "is_invalid_grad_norm", "is_model_parallel_parameter",
           "mask_nan_or_inf_with_val_inplace", "model_parallel_of", "split_squares"]

CLIP_EPS = 1e-6  # torch.nn.utils.clip_grad_norm_'s: max_norm / (norm + CLIP_EPS)
PIPE_REPLICATED = "ds_pipe_replicated"  # DeepSpeed's mark of a tied copy on another stage


def is_model_parallel_parameter(p: Any) -> bool:
    """Whether ``p`` is split across the model-parallel group (marked
    ``model_parallel`` or ``tensor_model_parallel``)."""
    return bool(getattr(p, "model_parallel", False)
                or getattr(p, "tensor_model_parallel", False))


def tensor_model_parallel_rank(mpu: Any) -> int:
    """This rank in ``mpu``'s tensor-parallel group (0 without an mpu), by
    whichever name the mpu answers (Megatron's old and new, DeepSpeed's)."""
    if mpu is None:
        return 0
    for name in ("get_tensor_model_parallel_rank", "get_slice_parallel_rank",
                 "get_model_parallel_rank"):
        if hasattr(mpu, name):
            return int(getattr(mpu, name)())
    return 0


@dataclass(frozen=True)
class ModelParallel:
    """An mpu's model-parallel group of more than one rank, over which the
    engine's step reduces its gradient norm and overflow flag too."""

    group: Any
    size: int
    #: this rank in the tensor-parallel group (:func:`tensor_model_parallel_rank`)
    tp_rank: int

    def counts(self, param: Any) -> bool:
        """Whether this rank counts ``param`` in the norm: a split parameter
        on every rank, a replicated one on tensor-parallel rank 0 only."""
        return self.tp_rank == 0 or is_model_parallel_parameter(param)


def model_parallel_of(mpu: Any) -> Optional[ModelParallel]:
    """``mpu``'s model-parallel group when ``get_model_parallel_world_size()``
    is above 1 (DeepSpeed's ZeRO optimizers read that size), else None: no
    extra reduction at all (a pipeline's grid reports 1)."""
    if mpu is None or not hasattr(mpu, "get_model_parallel_world_size"):
        return None
    size = int(mpu.get_model_parallel_world_size())
    if size <= 1:
        return None
    return ModelParallel(mpu.get_model_parallel_group(), size, tensor_model_parallel_rank(mpu))


def _dense(grad: torch.Tensor) -> torch.Tensor:
    return grad.coalesce().values() if grad.is_sparse else grad


def split_squares(counted: Sequence[torch.Tensor], others: Sequence[torch.Tensor],
                  device: torch.device) -> torch.Tensor:
    """The sum of the squared 2-norms of ``counted`` (each norm in float32,
    the sum in float64, a one-element tensor on ``device``; a sparse tensor
    by its values), ``inf`` when an element of ``others`` (the tensors this
    rank leaves to another) is not finite: a non-finite gradient anywhere
    makes every model-parallel rank's norm non-finite."""
    total = torch.zeros(1, dtype=torch.float64, device=device)
    for t in counted:
        total += torch.linalg.vector_norm(_dense(t), dtype=torch.float32).to(device).double() ** 2
    if others:
        rest = torch.stack([torch.linalg.vector_norm(_dense(t), dtype=torch.float32).to(device)
                            for t in others]).sum()
        total += torch.where(torch.isfinite(rest), 0.0, math.inf)
    return total


def clip_model_parallel_(pairs: Sequence[tuple[Any, torch.Tensor]], max_norm: float,
                         mp: ModelParallel) -> torch.Tensor:
    """The 2-norm of the gradients of ``pairs`` (parameter, its gradient to
    step on) over the whole model-parallel model (:meth:`ModelParallel.counts`,
    reduced over ``mp.group``), a float32 scalar; with ``max_norm`` > 0 every
    gradient is scaled by torch's coefficient ``max_norm / (norm + 1e-6)``
    clamped to 1 (the same on every model-parallel rank)."""
    total = split_squares([g for p, g in pairs if mp.counts(p)],
                          [g for p, g in pairs if not mp.counts(p)], _device())
    from dsrun import comm

    comm.all_reduce(total, op=comm.ReduceOp.SUM, group=mp.group)
    norm = total.sqrt().float().reshape(())
    if max_norm > 0:
        coefficient = torch.clamp(max_norm / (norm + CLIP_EPS), max=1.0)
        with torch.no_grad():
            for _, grad in pairs:
                grad.mul_(coefficient.to(grad.device, grad.dtype))
    return norm


def _device() -> torch.device:
    from dsrun.accelerator import get_accelerator

    return torch.device(get_accelerator().current_device_name())


def reduce_model_parallel(value: torch.Tensor, mpu: Any, maximum: bool) -> torch.Tensor:
    """``value`` reduced in place over ``mpu``'s model-parallel group (as it is
    without), through :mod:`dsrun.comm` so the communication logger sees it."""
    if mpu is not None:
        from dsrun import comm

        comm.all_reduce(value, op=comm.ReduceOp.MAX if maximum else comm.ReduceOp.SUM,
                        group=mpu.get_model_parallel_group())
    return value


def _as_list(tensors: Tensors) -> list[torch.Tensor]:
    return [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)


def _counted_once(params: Sequence[Any], mpu: Any) -> list[Any]:
    """The parameters a rank counts so that each counts once per model (module docstring)."""
    tp_rank = tensor_model_parallel_rank(mpu)
    return [p for p in params if not getattr(p, PIPE_REPLICATED, False)
            and (tp_rank == 0 or is_model_parallel_parameter(p))]


def _float_or_invalid(total: float) -> float:
    return total if math.isfinite(total) else -1


def get_weight_norm(parameters: Tensors, norm_type: float = 2, mpu: Any = None) -> float:
    """The ``norm_type``-norm of the parameters' values, over the whole
    model with an ``mpu``; ``-1`` when it is not finite."""
    params = _as_list(parameters)
    return _values_norm([p.data for p in params], [p.data for p in _counted_once(params, mpu)],
                        norm_type, mpu)


def _values_norm(every: list[torch.Tensor], counted: list[torch.Tensor], norm_type: float,
                 mpu: Any) -> float:
    """The norm of the values: the largest magnitude of ``every`` for ``inf``,
    else the p-norm of ``counted``, reduced over ``mpu``'s group (each
    tensor's norm in float32 as DeepSpeed's, their sum in float64)."""
    norm_type = float(norm_type)
    device = _device()
    total = torch.zeros(1, dtype=torch.float64, device=device)
    if norm_type == math.inf:
        for t in every:
            if t.numel():
                total = torch.maximum(total, t.detach().abs().max().to(device, torch.float64))
        return _float_or_invalid(float(reduce_model_parallel(total, mpu, True)[0]))
    for t in counted:
        norm = torch.linalg.vector_norm(t.detach(), norm_type, dtype=torch.float32)
        total += norm.to(device, torch.float64) ** norm_type
    total = reduce_model_parallel(total, mpu, False)
    return _float_or_invalid(float(total[0]) ** (1.0 / norm_type))


def _masked(grad: torch.Tensor, ranges: Optional[torch.Tensor]) -> torch.Tensor:
    """``grad`` (flat) with the ``[start, end)`` rows of ``ranges`` zeroed."""
    if ranges is None or len(ranges) == 0:
        return grad
    mask = torch.zeros(grad.shape[0], dtype=torch.bool, device=grad.device)
    for start, end in ranges.tolist():
        mask[int(start):int(end)] = True
    return grad.masked_fill(mask, 0)


def get_flattened_grad_norm(parameters: Tensors, norm_type: float = 2, mpu: Any = None,
                            grad_norm_mask: Optional[Sequence[torch.Tensor]] = None) -> float:
    """The ``norm_type``-norm of the parameters' gradients (those that have
    one), reduced over ``mpu``'s group; ``grad_norm_mask[i]``, a tensor of
    ``[start, end)`` rows, leaves those elements of parameter ``i``'s flat
    gradient out of a p-norm (not of the ``inf`` norm, as in DeepSpeed).
    ``-1`` when the norm is not finite."""
    params = [p for p in _as_list(parameters) if p.grad is not None]
    grads = [p.grad.data for p in params]
    masked = grads if grad_norm_mask is None else [
        _masked(g, grad_norm_mask[i]) for i, g in enumerate(grads)]
    return _values_norm(grads, masked, norm_type, mpu)


def get_grad_zeros(parameters: Tensors, mpu: Any = None) -> float:
    """How many gradient elements are exactly zero, over the whole model with
    an ``mpu`` (each parameter counted once, module docstring)."""
    params = [p for p in _as_list(parameters) if p.grad is not None]
    local = sum(p.grad.numel() - int(torch.count_nonzero(p.grad))
                for p in _counted_once(params, mpu))
    # float64: exact up to 2**53 elements (DeepSpeed sums in float32)
    total = torch.tensor([float(local)], dtype=torch.float64, device=_device())
    reduce_model_parallel(total, mpu, False)
    return float(total[0])


def has_inf_or_nan(x: torch.Tensor) -> torch.Tensor:
    """Whether ``x`` holds a NaN or an infinity, as a bool scalar tensor on
    ``x``'s device (no host synchronisation; ``bool()`` it for a bool). A
    sparse tensor's stored values are checked; an empty tensor holds none."""
    if x.is_sparse:
        x = x._values()
    if x.numel() == 0:
        return torch.tensor(False, device=x.device)
    low, high = torch.aminmax(x)  # one pass; a NaN makes both NaN
    return torch.isfinite(low).logical_and(torch.isfinite(high)).logical_not()


def is_invalid_grad_norm(norm: Any) -> bool:
    """Whether ``norm`` (a number or a tensor) is not finite or is negative
    (the ``-1`` the helpers here return for an overflow)."""
    if torch.is_tensor(norm):
        return bool((~torch.isfinite(norm) | (norm < 0)).any())
    return not math.isfinite(float(norm)) or norm < 0


def mask_nan_or_inf_with_val_inplace(input: torch.Tensor, device: Any = None,
                                     val: float = -1.0) -> None:
    """Replace ``input``'s NaNs and infinities by ``val`` in place
    (DeepSpeed's writes -1 whatever ``val`` says; the default is the same)."""
    input.masked_fill_(input.isnan() | input.isinf(), val)


def combine_grad_norm_groups(norm_groups: Iterable[Any], norm_type: float = 2) -> torch.Tensor:
    """The ``norm_type``-norm of per-group norms; ``inf`` when one is not
    finite or negative (an invalid group stays invalid, not a unit norm)."""
    norms = list(norm_groups)
    device = next((n.device for n in norms if torch.is_tensor(n)), None)
    stacked = torch.stack([n if torch.is_tensor(n)
                           else torch.tensor(n, dtype=torch.float, device=device) for n in norms])
    invalid = (~torch.isfinite(stacked) | (stacked < 0)).any()
    combined = torch.linalg.vector_norm(stacked, ord=norm_type)
    return torch.where(invalid, torch.full_like(combined, math.inf), combined)


def get_global_norm_of_tensors(input_tensors: Sequence[torch.Tensor], norm_type: float = 2,
                               mpu: Any = None, moe_ep_group: Any = None) -> torch.Tensor:
    """The ``norm_type``-norm of ``input_tensors`` as one vector, a detached
    float32 scalar on the first tensor's device, reduced over ``mpu``'s
    group (or over ``moe_ep_group`` without an mpu); ``-1`` when not finite."""
    tensors = list(input_tensors)
    if not tensors or not all(torch.is_tensor(t) for t in tensors):
        raise TypeError(f"get_global_norm_of_tensors: expected a non-empty list of tensors, got "
                        f"{[type(t).__name__ for t in tensors]}")
    if mpu is not None and moe_ep_group is not None:
        raise ValueError("get_global_norm_of_tensors: dsrun has no expert model parallelism; "
                         "give mpu or moe_ep_group, not both")
    norm_type = float(norm_type)
    device = _device()
    if norm_type == math.inf:
        total = torch.stack([t.detach().abs().max().float().to(device) for t in tensors]).max()
    else:
        total = torch.stack([t.detach().float().norm(norm_type).to(device)
                             for t in tensors]).pow(norm_type).sum()
    reduce_model_parallel(total, mpu, norm_type == math.inf)
    from dsrun.comm import pg_utils

    if pg_utils.is_parallel(moe_ep_group):
        from dsrun import comm

        comm.all_reduce(total, op=comm.ReduceOp.MAX if norm_type == math.inf
                        else comm.ReduceOp.SUM, group=moe_ep_group)
    if norm_type != math.inf:
        total = total.pow(1.0 / norm_type)
    total = total.to(tensors[0].device)
    mask_nan_or_inf_with_val_inplace(total)
    return total


def clip_tensors_by_global_norm(input_tensors: Sequence[torch.Tensor], max_norm: float = 1.0,
                                global_norm: Any = None, mpu: Any = None,
                                eps: float = 1e-6) -> Any:
    """Scale ``input_tensors`` in place so their global 2-norm (given, or
    :func:`get_global_norm_of_tensors`) is at most ``max_norm``; returns
    that norm. An invalid norm (``-1``, not finite) leaves them alone, where
    DeepSpeed's would scale them by a negative factor."""
    if global_norm is None:
        global_norm = get_global_norm_of_tensors(input_tensors, mpu=mpu)
    if is_invalid_grad_norm(global_norm):
        return global_norm
    clip_coef = max_norm / (global_norm + eps)
    if clip_coef < 1:
        for tensor in input_tensors:
            tensor.detach().mul_(clip_coef)
    return global_norm
