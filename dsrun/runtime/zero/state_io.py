"""The ZeRO optimizers' side of the checkpoint interface.

:mod:`dsrun.runtime.checkpoint.fragments` defines what a checkpoint asks of
a state holder: ``export_state`` (save), ``prepare_import`` and
``finish_import`` (load), all per parameter name. This module implements
them once for everything that lives in the fp32 masters and the inner
optimizer (:class:`MasterStateIO`), plus what differs per stage: where each
parameter's elements lie in its group's master (:meth:`_master_runs`, as
:class:`MasterRun`), which tensors a stage declares (:meth:`_declared`),
fragments of tensors without a master (stage 3's frozen shards) and how
the model is refreshed after a load (:meth:`_refresh_after_import`, a
collective). The ZeRO optimizers inherit :class:`ShardedStateIO` (stages
1-2) or :class:`Stage3StateIO` (stage 3); nothing else of theirs is
visible to the checkpoint package.

Fragments are split where the inner optimizer's sub-group pieces split the
master, so each one's optimizer state is a plain view. On load the masters
are written only where the checkpoint had data; the new optimizer state of
a piece is filled by the checkpoint and, where it has nothing (skipped
tensors, padding), keeps the current value or zero.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple, Optional

import torch

from dsrun.errors import DsrunError
from dsrun.runtime.checkpoint.fragments import (
    ExportedState,
    Fragment,
    ImportPlan,
    LoadTarget,
    TensorInfo,
    check_state,
    group_hyperparameters,
    per_element,
    split_state,
    staged_state,
)


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
    staged: dict[str, Any]                   # check_import's optimizer state dict


class MasterStateIO:
    """The checkpoint interface over masters and the inner optimizer
    (module docstring). Needs ``masters``, ``optimizer`` and ``_pieces``
    (:class:`~.masters.MasterGradients`)."""

    masters: list[torch.nn.Parameter]
    optimizer: torch.optim.Optimizer
    _pieces: list[list[torch.nn.Parameter]]

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
                                               tuple(piece.shape), where)
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
        private = _Imported(spans, piece_state, piece_targets, (extra, extra_targets), {})
        return ImportPlan(self._declared(names), targets, type(self.optimizer).__name__, private)

    def check_import(self, plan: ImportPlan, groups: Optional[Sequence[Mapping[str, Any]]],
                     optimizer_states: bool) -> None:
        """Build the optimizer state the load installs and check that the
        inner optimizer accepts it; nothing live changes (the loader calls
        this on every rank and raises any failure everywhere first)."""
        private: _Imported = plan.private
        private.staged.clear()
        if optimizer_states:
            states: dict[int, Optional[dict[str, Any]]] = {}
            for pieces in self._pieces:
                for piece in pieces:
                    targets = private.piece_targets.get(id(piece), [])
                    if any(t.loaded for t, _ in targets):
                        states[id(piece)] = _piece_state(
                            private.piece_state.get(id(piece), {}),
                            self.optimizer.state.get(piece, {}), piece, targets)
            state_dict = staged_state(self.optimizer, states, groups)
            check_state(self.optimizer, state_dict)
            private.staged["state_dict"] = state_dict

    def finish_import(self, plan: ImportPlan, groups: Optional[Sequence[Mapping[str, Any]]],
                      optimizer_states: bool) -> None:
        """Install what :meth:`prepare_import` staged and the loader filled;
        then refresh the model parameters (collective)."""
        private: _Imported = plan.private
        if optimizer_states and "state_dict" not in private.staged:
            self.check_import(plan, groups, optimizer_states)  # before anything changes
        with torch.no_grad():  # only what was loaded: the rest keeps its value
            for g, lo, hi, target in private.masters:
                if target.loaded:
                    self.masters[g][lo:hi].copy_(target.value)
        if optimizer_states:
            self.optimizer.load_state_dict(private.staged.pop("state_dict"))
        extra, extra_targets = private.extra
        self._finish_extra(extra, extra_targets)
        self._refresh_after_import()


class ShardedStateIO(MasterStateIO):
    """Stages 1-2: flat partitions of each param group (:mod:`.partition`)."""

    layouts: Any
    param_groups_full: list[list[torch.Tensor]]
    rank: int

    def _name(self, names: Mapping[int, str], param: torch.Tensor) -> str:
        name = names.get(id(param))
        if name is None:
            raise DsrunError(f"a trainable parameter of shape {tuple(param.shape)} in the "
                             "optimizer is not a parameter of the module: it cannot be "
                             "checkpointed by name")
        return name

    def _master_runs(self, names: Mapping[int, str]) -> list[list[MasterRun]]:
        runs = []
        for layout, params in zip(self.layouts, self.param_groups_full):
            start, _ = layout.rank_range(self.rank)
            runs.append([MasterRun(self._name(names, params[piece.param]), piece.param_offset,
                                   piece.flat_offset - start, piece.length)
                         for piece in layout.pieces(self.rank)])
        return runs

    def _declared(self, names: Mapping[int, str]) -> dict[str, TensorInfo]:
        """The trainable parameters (frozen ones stay whole in the model)."""
        return {self._name(names, params[i]): TensorInfo(
                    self._name(names, params[i]), tuple(params[i].shape), params[i].dtype,
                    "param", g)
                for g, (layout, params) in enumerate(zip(self.layouts, self.param_groups_full))
                for i in layout.members}

    def _refresh_after_import(self) -> None:
        self._gather_params()


class Stage3StateIO(MasterStateIO):
    """Stage 3: every parameter's own shard; those without a master (frozen
    at initialize(), or in no param group) saved from their shards."""

    layouts: Any
    param_groups_full: list[list[torch.Tensor]]
    rank: int
    _slot: dict[int, tuple[int, int]]

    def _name(self, names: Mapping[int, str], param: torch.Tensor) -> str:
        name = names.get(id(param))
        if name is None:
            raise DsrunError(f"{param.ds_name or 'a parameter'} is not a parameter of the "
                             "module: it cannot be checkpointed by name")
        return name

    def _own_range(self, param: torch.Tensor) -> tuple[int, int]:
        """This rank's ``[start, end)`` of ``param``'s flat elements (padding cut)."""
        spec = param.ds_spec
        start = self.rank * spec.shard_numel
        return start, start + spec.valid(self.rank)

    def _master_runs(self, names: Mapping[int, str]) -> list[list[MasterRun]]:
        runs = []
        for params, layout in zip(self.param_groups_full, self.layouts):
            group_runs = []
            for p, offset in zip(params, layout.offsets):
                start, end = self._own_range(p)
                if offset is not None and end > start:
                    group_runs.append(MasterRun(self._name(names, p), start, offset, end - start))
            runs.append(group_runs)
        return runs

    def _declared(self, names: Mapping[int, str]) -> dict[str, TensorInfo]:
        """Every managed parameter: those with a master with their group, the
        others (partitioned too) with none."""
        group_of = {id(p): g for g, ps in enumerate(self.param_groups_full) for p in ps
                    if p.ds_id in self._slot}
        return {self._name(names, p): TensorInfo(self._name(names, p), tuple(p.ds_shape),
                                                 p.ds_tensor.dtype, "param", group_of.get(id(p)))
                for p in self.managed_params()}

    def _frozen(self) -> list[torch.Tensor]:
        """The parameters without a master (by slot, not by the current
        ``requires_grad``: one frozen since initialize() keeps its master)."""
        return [p for p in self.managed_params() if p.ds_id not in self._slot]

    def _extra_fragments(self, names: Mapping[int, str]) -> list[Fragment]:
        """Frozen parameters' shards, in their own dtype."""
        out = []
        for p in self._frozen():
            start, end = self._own_range(p)
            if end > start:
                out.append(Fragment(self._name(names, p), start, end,
                                    p.ds_tensor.detach()[:end - start]))
        return out

    def _extra_targets(self, names: Mapping[int, str]) -> tuple[list[LoadTarget], Any]:
        targets, params = [], []
        for p in self._frozen():
            start, end = self._own_range(p)
            if end > start:
                targets.append(LoadTarget(self._name(names, p), start, end,
                                          torch.empty_like(p.ds_tensor[:end - start])))
                params.append(p)
        return targets, params

    @torch.no_grad()
    def _finish_extra(self, extra: Any, targets: Any) -> None:
        for p, target in zip(extra, targets):
            if target.loaded:
                p.ds_tensor[:target.end - target.start].copy_(target.value)

    def _refresh_after_import(self) -> None:
        self._write_back()


def _fresh_state(current: Mapping[str, Any], piece: torch.Tensor,
                 keys: Sequence[str]) -> dict[str, torch.Tensor]:
    """Per-element state for ``piece`` to load into (uninitialised: what
    the checkpoint does not fill is filled by :func:`_fill_the_rest`)."""
    return {key: torch.empty(piece.numel(), dtype=torch.float32, device=piece.device)
            for key in keys}


def _piece_state(fresh: dict[str, torch.Tensor], current: Mapping[str, Any],
                 piece: torch.Tensor, targets: Sequence[tuple[LoadTarget, int]]
                 ) -> Optional[dict[str, Any]]:
    """A piece's new optimizer state, some of whose targets were loaded.
    None (fresh state, as at stage 0) when the checkpoint has no state for
    any of it (parameters frozen when it was saved, a save before the first
    step) and no part keeps its current state. Otherwise the per-element
    state (:func:`_fill_the_rest`) and the scalars (``step``) of the first
    target the checkpoint has them for, else the current ones: elements
    the checkpoint has no state for start from zero, as fresh state does,
    but share the piece's ``step``."""
    loaded = [t for t, _ in targets if t.loaded]
    saved = [t for t in loaded if t.state or t.scalars]
    if not saved and (len(loaded) == len(targets) or not current):
        return None
    _fill_the_rest(fresh, current, targets)
    scalars = next((t.scalars for t in saved if t.scalars), None)
    if scalars is None:
        scalars = {k: v for k, v in current.items() if not per_element(k, v, piece.shape)}
    return {**fresh, **scalars} or None


def _fill_the_rest(fresh: Mapping[str, torch.Tensor], current: Mapping[str, Any],
                   targets: Sequence[tuple[LoadTarget, int]]) -> None:
    """The elements of a piece's new state that no loaded target filled:
    those of loaded targets the checkpoint has no such state for start
    from zero; the rest (skipped tensors, padding) keep the current value,
    or zero when there is none."""
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
        for t, o in targets:
            if t.loaded and key not in t.state:
                tensor[o:o + t.end - t.start].zero_()
