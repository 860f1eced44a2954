"""What every ZeRO stage does the same way on its fp32 master partitions.

:class:`MasterGradients` is the shared base of the stage 1/2
(:class:`~.sharded.ZeroOptimizer`) and stage 3 (:class:`~.stage3.ZeroStage3`)
optimizers: fp16 unscaling, the overflow check every rank agrees on, the
global gradient norm computed from the partitions, and torch's clipping
rule. A subclass provides ``masters`` (flat fp32 tensors whose ``.grad``
holds this rank's partition of the mean gradient after
:meth:`reduce_gradients`), ``optimizer`` (the inner torch optimizer),
``group``, ``world_size`` and ``comm_device`` (where the group's backend
reduces: the masters may be in host memory under ``offload_optimizer``);
it may override :meth:`_all_reduce` to announce each collective (stage 3's
divergence guard).

**Sub-groups.** The inner optimizer steps each master in pieces of at most
``sub_group_size`` elements (DeepSpeed's knob of that name): each piece is
a ``Parameter`` that is a view of the master, its gradient a view of the
master's ``.grad`` (bound by :meth:`_step_inner`). Elementwise optimizers
give the same values bitwise; what changes is the size of the optimizer's
temporaries (Adam's ``sqrt`` of the whole second moment, ...): host memory
allocations above glibc's mmap threshold (32 MiB at most) are returned to
the kernel when freed and page-faulted in again on every step, which on the
bench model cost more than the optimizer's arithmetic.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist

CLIP_EPS = 1e-6  # torch.nn.utils.clip_grad_norm_'s


def reduce_on_device(value: torch.Tensor, op: Any, group: Any, device: torch.device) -> None:
    """All-reduce ``value`` in place through ``device`` (the backend's: a
    NCCL group cannot reduce host tensors, which offloaded masters are)."""
    if value.device == device:
        dist.all_reduce(value, op=op, group=group)
        return
    staged = value.to(device)
    dist.all_reduce(staged, op=op, group=group)
    value.copy_(staged)


def split_master(master: torch.nn.Parameter, size: int) -> list[torch.nn.Parameter]:
    """``master`` itself when it has at most ``size`` elements, else
    parameters that are views of consecutive ``size``-element pieces."""
    if size < 1:
        raise ValueError(f"sub_group_size must be >= 1, got {size}")
    n = master.numel()
    if n <= size:
        return [master]
    flat = master.detach()
    return [torch.nn.Parameter(flat.narrow(0, a, min(size, n - a))) for a in range(0, n, size)]


class MasterGradients:
    masters: list[torch.nn.Parameter]
    optimizer: torch.optim.Optimizer
    group: Any
    world_size: int
    comm_device: torch.device

    def reduce_gradients(self) -> None:  # pragma: no cover - every subclass defines it
        raise NotImplementedError

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @property
    def state(self) -> Any:
        return self.optimizer.state

    def _all_reduce(self, value: torch.Tensor, op: Any, what: str) -> None:
        if self.world_size > 1:
            reduce_on_device(value, op, self.group, self.comm_device)

    def _inner_groups(self, hyper: list[dict[str, Any]], sub_group_size: int
                      ) -> list[dict[str, Any]]:
        """The inner optimizer's param groups: each master, in sub-groups."""
        self._pieces = [split_master(m, sub_group_size) for m in self.masters]
        return [{**h, "params": pieces} for h, pieces in zip(hyper, self._pieces)]

    def _step_inner(self) -> None:
        """Bind each piece's gradient to its view of the master gradient, step."""
        for master, pieces in zip(self.masters, self._pieces):
            if len(pieces) == 1 and pieces[0] is master:
                continue
            offset = 0
            for piece in pieces:
                size = piece.numel()
                piece.grad = None if master.grad is None else \
                    master.grad.narrow(0, offset, size)
                offset += size
        self.optimizer.step()

    def _clear_master_grads(self, set_to_none: bool) -> None:
        for master, pieces in zip(self.masters, self._pieces):
            if set_to_none or master.grad is None:
                master.grad = None
                for piece in pieces:  # their views would keep the storage alive
                    piece.grad = None
            else:
                master.grad.zero_()

    def _new_grad(self, master: torch.Tensor) -> torch.Tensor:
        """A zero gradient accumulator for ``master`` (pinned like it)."""
        return torch.zeros(master.shape, dtype=master.dtype, device=master.device,
                           pin_memory=master.is_pinned())

    def scale_grads_(self, factor: float) -> None:
        """Multiply the partition gradients by ``factor`` (fp16 unscaling)."""
        self.reduce_gradients()
        if factor != 1.0:
            for master in self.masters:
                master.grad.mul_(factor)  # type: ignore[union-attr]

    def has_overflow(self) -> bool:
        """True on every rank when any rank's partition gradient has an
        inf/NaN (one all-reduce of a flag)."""
        self.reduce_gradients()
        bad = any(not bool(torch.isfinite(m.grad).all()) for m in self.masters)  # type: ignore
        flag = torch.tensor([1.0 if bad else 0.0], device=self.masters[0].device)
        self._all_reduce(flag, dist.ReduceOp.MAX, "overflow check")
        return bool(flag.item() > 0)

    def grad_norm(self, norm_type: float = 2.0) -> torch.Tensor:
        """Global norm of the full mean gradient, from the partitions (the
        value ``clip_grad_norm_`` would compute on the full gradient, up to
        rounding: 2-norm as sqrt of all-reduced squared partition norms;
        padding is zero and adds nothing)."""
        self.reduce_gradients()
        grads = [m.grad for m in self.masters if m.numel()]
        device = self.masters[0].device
        if norm_type == math.inf:
            local = max((g.abs().max() for g in grads), default=torch.zeros((), device=device))
            total, op = local.to(torch.float32).reshape(1), dist.ReduceOp.MAX
        elif norm_type == 2.0:
            squares = [torch.linalg.vector_norm(g, dtype=torch.float32).double() ** 2
                       for g in grads]
            total = torch.stack(squares).sum().reshape(1) if squares else \
                torch.zeros(1, dtype=torch.float64, device=device)
            op = dist.ReduceOp.SUM
        else:
            raise ValueError(f"norm_type {norm_type} unsupported: use 2.0 or inf")
        self._all_reduce(total, op, "gradient norm")
        norm = total if norm_type == math.inf else total.sqrt()
        return norm.to(torch.float32).reshape(())

    def clip_grad_norm(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Scale the partition gradients so that the global norm is at most
        ``max_norm`` (torch's rule: coefficient ``max_norm / (norm + 1e-6)``
        clamped to 1); returns the norm before clipping."""
        norm = self.grad_norm(norm_type)
        if max_norm > 0:
            coefficient = torch.clamp(max_norm / (norm + CLIP_EPS), max=1.0)
            for master in self.masters:
                master.grad.mul_(coefficient)  # type: ignore[union-attr]
        return norm
