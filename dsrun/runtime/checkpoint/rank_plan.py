"""What each rank of a save writes: its chunks, in file order, and what its
record declares (tensors, scalars, optimizer groups) - planned from the
engine's exported state (pure, no I/O; :mod:`.writer` writes the plan).

A rank writes its own fragments plus its share of the *replicated* ones
(state every rank of a replica group holds, split flat among them in order):
every byte of the checkpoint is written exactly once.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from dsrun.errors import CheckpointError
from dsrun.runtime.checkpoint.fragments import ExportedState, Fragment
from dsrun.runtime.checkpoint.manifest import VALUE, encode
from dsrun.runtime.checkpoint.storage import dtype_name
from dsrun.runtime.zero.partition import partition_group


@dataclass(frozen=True)
class Planned:
    """One chunk of this rank's data file: ``tensor`` (1-D) at ``offset``."""

    name: str
    item: str
    dtype: str
    start: int
    end: int
    offset: int
    tensor: torch.Tensor
    volatile: bool = False


@dataclass
class RankPlan:
    """What this rank writes (chunks, declarations, scalars, groups)."""

    chunks: list[Planned] = field(default_factory=list)
    tensors: dict[str, dict[str, Any]] = field(default_factory=dict)
    scalars: dict[str, dict[str, Any]] = field(default_factory=dict)
    groups: tuple[Any, ...] = ()
    optimizer: Optional[str] = None
    bytes: int = 0


def own_share(export: ExportedState) -> list[Fragment]:
    """The fragments this rank writes: its own, plus its ``replica`` share
    of the replicated ones (a flat split of all of them, in order)."""
    own = [f for f in export.fragments if not f.replicated]
    shared = [f for f in export.fragments if f.replicated]
    if not shared:
        return own
    index, count = export.replica
    layout = partition_group([f.end - f.start for f in shared], count)
    for piece in layout.pieces(index):
        frag = shared[piece.param]
        start = frag.start + piece.param_offset
        own.append(frag.narrowed(start, start + piece.length))
    return own


def plan_rank(exports: Sequence[ExportedState]) -> RankPlan:
    plan = RankPlan()
    for export in exports:
        for info in export.tensors.values():
            if info.name in plan.tensors:
                raise CheckpointError(f"tensor {info.name!r} is declared by two state sources")
            plan.tensors[info.name] = {"shape": list(info.shape), "dtype": dtype_name(info.dtype),
                                       "kind": info.kind, "group": info.group}
        if export.optimizer and not plan.optimizer:
            plan.optimizer = export.optimizer
            plan.groups = tuple({k: encode(v) for k, v in g.items()} for g in export.groups)
        for frag in own_share(export):
            if frag.scalars and frag.name not in plan.scalars:
                plan.scalars[frag.name] = {k: encode(v) for k, v in frag.scalars.items()}
            for item, tensor in ((VALUE, frag.value), *frag.state.items()):
                plan.chunks.append(Planned(frag.name, item, dtype_name(tensor.dtype), frag.start,
                                           frag.end, plan.bytes, tensor, frag.volatile))
                plan.bytes += tensor.numel() * tensor.element_size()
    return plan
