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

**Checkpoints.** The base class implements the checkpoint interface of
:mod:`dsrun.runtime.checkpoint.fragments` (``export_state``,
``prepare_import``, ``finish_import``) for everything that lives in the
masters and the inner optimizer; a subclass says where each parameter's
elements lie in its group's master (:meth:`_master_runs`, as
:class:`MasterRun`), declares its tensors (:meth:`_declared`), may add
fragments of tensors without a master (:meth:`_extra_fragments`, stage 3's
frozen shards) and refreshes the model after a load
(:meth:`_refresh_after_import`). Fragments are split where the inner
optimizer's sub-group pieces split the master, so each one's optimizer
state is a plain view.

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
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple, Optional

import torch
import torch.distributed as dist

from dsrun.runtime.checkpoint.fragments import (
    ExportedState,
    Fragment,
    ImportPlan,
    LoadTarget,
    TensorInfo,
    group_hyperparameters,
    install_state,
    split_state,
)

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


class MasterRun(NamedTuple):
    """``length`` elements of parameter ``name`` from ``param_start`` (flat,
    no padding) lying in the group's master from ``master_offset``."""

    name: str
    param_start: int
    master_offset: int
    length: int


class _Imported(NamedTuple):
    """The bookkeeping between prepare_import and finish_import."""

    masters: list[tuple[int, int, int, LoadTarget]]  # (master, lo, hi, target) to copy in
    piece_state: dict[int, dict[str, torch.Tensor]]  # id(piece) -> new per-element state
    piece_targets: dict[int, list[tuple[LoadTarget, int]]]  # id(piece) -> (target, offset)
    extra: Any                               # the subclass's (stage 3: frozen shards)


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

    # ------------------------------------------------------------ checkpoints

    def _master_runs(self, names: Mapping[int, str]) -> list[list[MasterRun]]:
        """Per master: where this rank's parameter elements lie in it."""
        raise NotImplementedError  # pragma: no cover - every subclass defines it

    def _declared(self, names: Mapping[int, str]) -> dict[str, TensorInfo]:
        raise NotImplementedError  # pragma: no cover

    def _extra_fragments(self, names: Mapping[int, str]) -> list[Fragment]:
        return []

    def _extra_targets(self, names: Mapping[int, str]) -> tuple[list[LoadTarget], Any]:
        return [], None

    def _finish_extra(self, extra: Any, targets: Sequence[LoadTarget]) -> None:
        """Copy the loaded extra targets in (before the refresh)."""

    def _refresh_after_import(self) -> None:
        raise NotImplementedError  # pragma: no cover

    def _piece_spans(self, g: int) -> list[tuple[int, int, torch.nn.Parameter]]:
        """``(start, end, piece)`` of each inner-optimizer piece in master ``g``."""
        spans = []
        offset = 0
        for piece in self._pieces[g]:
            spans.append((offset, offset + piece.numel(), piece))
            offset += piece.numel()
        return spans

    def _cut(self, names: Mapping[int, str]):  # type: ignore[no-untyped-def]
        """Yield ``(g, run, lo, hi, piece_start, piece)``: each run cut at
        the pieces' boundaries (master offsets ``[lo, hi)``)."""
        for g, runs in enumerate(self._master_runs(names)):
            spans = self._piece_spans(g)
            for run in runs:
                end = run.master_offset + run.length
                for a, b, piece in spans:
                    lo, hi = max(a, run.master_offset), min(b, end)
                    if lo < hi:
                        yield g, run, lo, hi, a, piece

    def export_state(self, names: Mapping[int, str]) -> ExportedState:
        """This rank's masters and optimizer state as fragments (views)."""
        fragments = []
        for g, run, lo, hi, a, piece in self._cut(names):
            where = f"{run.name} (param group {g})"
            elementwise, scalars = split_state(self.optimizer.state.get(piece, {}),
                                               piece.numel(), where)
            start = run.param_start + lo - run.master_offset
            fragments.append(Fragment(
                run.name, start, start + hi - lo, self.masters[g].detach()[lo:hi],
                {k: v[lo - a:hi - a] for k, v in elementwise.items()}, scalars))
        fragments.extend(self._extra_fragments(names))
        return ExportedState(self._declared(names), tuple(fragments),
                             group_hyperparameters(self.optimizer),
                             type(self.optimizer).__name__)

    def prepare_import(self, names: Mapping[int, str],
                       state_keys: Optional[Sequence[str]]) -> ImportPlan:
        """Staging copies of the masters and fresh optimizer state to fill;
        nothing live changes until :meth:`finish_import`."""
        staging = [torch.empty_like(m.detach()) for m in self.masters]
        spans: list[tuple[int, int, int, LoadTarget]] = []
        piece_state: dict[int, dict[str, torch.Tensor]] = {}
        piece_targets: dict[int, list[tuple[LoadTarget, int]]] = {}
        targets: list[LoadTarget] = []
        for g, run, lo, hi, a, piece in self._cut(names):
            state: dict[str, torch.Tensor] = {}
            if state_keys is not None:
                if id(piece) not in piece_state:
                    piece_state[id(piece)] = _fresh_state(self.optimizer.state.get(piece, {}),
                                                          piece, state_keys)
                state = {k: v[lo - a:hi - a] for k, v in piece_state[id(piece)].items()}
            start = run.param_start + lo - run.master_offset
            target = LoadTarget(run.name, start, start + hi - lo, staging[g][lo:hi], state)
            targets.append(target)
            spans.append((g, lo, hi, target))
            piece_targets.setdefault(id(piece), []).append((target, lo - a))
        extra_targets, extra = self._extra_targets(names)
        targets.extend(extra_targets)
        private = _Imported(spans, piece_state, piece_targets, (extra, extra_targets))
        return ImportPlan(self._declared(names), targets, type(self.optimizer).__name__, private)

    def finish_import(self, plan: ImportPlan, groups: Optional[Sequence[Mapping[str, Any]]],
                      optimizer_states: bool) -> None:
        """Install what :meth:`prepare_import` staged and the loader filled;
        then refresh the model parameters (collective)."""
        private: _Imported = plan.private
        with torch.no_grad():  # only what was loaded: the rest keeps its value
            for g, lo, hi, target in private.masters:
                if target.loaded:
                    self.masters[g][lo:hi].copy_(target.value)
        if optimizer_states:
            states: dict[int, Optional[dict[str, Any]]] = {}
            for pieces in self._pieces:
                for piece in pieces:
                    targets = private.piece_targets.get(id(piece), [])
                    loaded = [t for t, _ in targets if t.loaded]
                    if loaded:
                        fresh = private.piece_state.get(id(piece), {})
                        _fill_the_rest(fresh, self.optimizer.state.get(piece, {}), targets)
                        states[id(piece)] = {**fresh, **loaded[0].scalars} or None
            install_state(self.optimizer, states, groups)
        extra, extra_targets = private.extra
        self._finish_extra(extra, extra_targets)
        self._refresh_after_import()


def _fresh_state(current: Mapping[str, Any], piece: torch.Tensor,
                 keys: Sequence[str]) -> dict[str, torch.Tensor]:
    """Per-element state for ``piece`` to load into (uninitialised: what
    the checkpoint does not fill is filled by :func:`_fill_the_rest`)."""
    return {key: torch.empty(piece.numel(), dtype=torch.float32, device=piece.device)
            for key in keys}


def _fill_the_rest(fresh: Mapping[str, torch.Tensor], current: Mapping[str, Any],
                   targets: Sequence[tuple[LoadTarget, int]]) -> None:
    """The elements of a piece's new state that no loaded target filled
    (skipped tensors, keys the checkpoint lacks, padding) keep the current
    value, or zero when there is none."""
    for key, tensor in fresh.items():
        filled = sorted((o, o + t.end - t.start) for t, o in targets
                        if t.loaded and key in t.state)
        value = current.get(key)
        old = value.detach().reshape(-1) if isinstance(value, torch.Tensor) and \
            value.numel() == tensor.numel() and value.dim() else None
        position = 0
        for a, b in [*filled, (tensor.numel(), tensor.numel())]:
            if a > position and old is not None:
                tensor[position:a].copy_(old[position:a])
            elif a > position:
                tensor[position:a].zero_()
            position = max(position, b)
