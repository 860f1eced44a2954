"""DeepSpeed's flat partitions -> whole parameters (pure tensor maths, no I/O).

What :mod:`.from_deepspeed` gets from each rank's files, and how the
parameters are cut out of it:

* **ZeRO 1-2** (:func:`zero12_params`): per param group, the parameters
  (in the order of ``param_shapes[g]``) lie back to back in one flat
  buffer, each followed by its alignment padding
  (``param_alignment_paddings[g][i]``, 0 unless parameter alignment is on);
  the buffer is cut into equal partitions, one per rank. Each rank saved
  its fp32 partition without its trailing padding (``group_paddings``,
  nonzero on the last ranks only) and the inner optimizer's state of the
  whole padded partition (``exp_avg`` ..., one flat tensor per group, plus
  ``step``). Concatenating the ranks' partitions (the state trimmed like
  the masters) gives the group's flat buffer. DeepSpeed's BF16_Optimizer
  (bf16 at stage 1 with fp32 gradient accumulation) lays its groups out
  the same way without alignment padding between parameters, and saves
  whole partitions, padding included.
* **ZeRO 3** (:func:`zero3_params`): every parameter is split into
  ``ceil(numel / world)`` elements per rank (the last rank padded); per
  sub-group, a rank's flat fp32 buffer and optimizer state are its slices
  of the sub-group's parameters (``param_shapes[sg]``) back to back.
  Sub-group ``k`` is the optimizer's ``k``-th tensor, which says the param
  group. Frozen parameters are split the same way (:func:`unpartition`).
* **Stage 0** (:func:`stage0_params`): the torch optimizer steps the
  module's fp32 parameters; its state dict keys them by position.

Each trained parameter becomes a :class:`Param` - its flat fp32 master and
per-element optimizer state without padding, the rest of its optimizer
state (``step``) and its param group - which is what a dsrun checkpoint
stores per name. A layout that does not add up (a partition of another
size than its parameters need, ranks that disagree on ``step``) is a
:class:`~dsrun.errors.CheckpointError` naming the file; optimizer state
that is not one value per element is an :class:`UnsupportedCheckpoint`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Optional

import torch

from dsrun.errors import CheckpointError
from dsrun.runtime.checkpoint.fragments import split_state
from dsrun.runtime.checkpoint.from_deepspeed_files import UnsupportedCheckpoint

Shapes = Sequence[Mapping[str, Sequence[int]]]


@dataclass(frozen=True)
class Param:
    """One trained parameter, whole (module docstring)."""

    name: str
    shape: tuple[int, ...]
    group: int
    master: torch.Tensor                       # flat fp32
    state: Mapping[str, torch.Tensor] = field(default_factory=dict)   # flat, per element
    scalars: Mapping[str, Any] = field(default_factory=dict)


class RankGroups(NamedTuple):
    """One rank's flat fp32 buffers and their optimizer state (None: no
    state yet), by group (stages 1-2) or sub-group (stage 3)."""

    where: str                                 # the file, for messages
    flat: Sequence[torch.Tensor]
    state: Sequence[Optional[Mapping[str, Any]]]
    paddings: Sequence[int] = ()               # stages 1-2: trailing padding of each


def _numel(shape: Sequence[int]) -> int:
    return math.prod(int(s) for s in shape)


def _split(state: Optional[Mapping[str, Any]], length: int | tuple[int, ...], where: str
           ) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    if not state:
        return {}, {}
    try:
        return split_state(state, length, where)
    except ValueError as exc:
        raise UnsupportedCheckpoint(f"{exc} (the importer needs optimizer state that is flat "
                                    "per element, as Adam's)") from None


def _same_scalars(first: Mapping[str, Any], other: Mapping[str, Any], where: str) -> None:
    for key in set(first) | set(other):
        a, b = first.get(key), other.get(key)
        same = torch.equal(torch.as_tensor(a), torch.as_tensor(b)) \
            if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor) else a == b
        if not same:
            raise CheckpointError(f"{where}: optimizer state {key!r} is {b!r} there but {a!r} on "
                                  "rank 0: the ranks' files are not of one save")


def _joined(ranks: Sequence[RankGroups], g: int, lengths: Sequence[int]
            ) -> tuple[list[torch.Tensor], list[dict[str, torch.Tensor]], dict[str, Any]]:
    """Each rank's flat buffer of group ``g`` (its first ``lengths[r]``
    elements), the same slice of its per-element state, and the scalars."""
    flats, states, scalars = [], [], None
    for r, rank in enumerate(ranks):
        flat = rank.flat[g]
        held = flat.numel() + (rank.paddings[g] if rank.paddings else 0)
        elementwise, rank_scalars = _split(rank.state[g], held, f"{rank.where}: group {g}")
        flats.append(flat.reshape(-1)[:lengths[r]])
        states.append({k: v[:lengths[r]] for k, v in elementwise.items()})
        if scalars is None:
            scalars = rank_scalars
        else:
            _same_scalars(scalars, rank_scalars, f"{rank.where}: group {g}")
        if set(states[-1]) != set(states[0]):
            raise CheckpointError(f"{rank.where}: group {g} has optimizer state "
                                  f"{sorted(states[-1])}, rank 0 {sorted(states[0])}")
    return flats, states, scalars or {}


def zero12_params(shapes: Shapes, ranks: Sequence[RankGroups],
                  alignment: Optional[Sequence[Sequence[int]]] = None,
                  slack: int = 1) -> list[Param]:
    """Stages 1-2 (module docstring): ``shapes[g]`` names group ``g``'s
    parameters in flat order; ``ranks[r]`` is rank ``r``'s lean fp32
    partitions, optimizer state and trailing paddings - or, for
    DeepSpeed's BF16_Optimizer, its whole partitions (no ``paddings``),
    whose joined length exceeds the parameters' by the group's alignment
    padding: less than ``slack`` elements."""
    out = []
    for g, names in enumerate(shapes):
        lengths = [rank.flat[g].numel() for rank in ranks]
        flats, states, scalars = _joined(ranks, g, lengths)
        flat = torch.cat(flats)
        state = {k: torch.cat([s[k] for s in states]) for k in states[0]}
        pads = list(alignment[g]) if alignment is not None else [0] * len(names)
        if len(pads) != len(names):
            raise CheckpointError(f"{ranks[0].where}: {len(pads)} alignment paddings for the "
                                  f"{len(names)} parameters of group {g}")
        offset = 0
        for (name, shape), pad in zip(names.items(), pads):
            n = _numel(shape)
            if offset + n > flat.numel():
                break
            out.append(Param(name, tuple(int(s) for s in shape), g, flat[offset:offset + n],
                             {k: v[offset:offset + n] for k, v in state.items()}, scalars))
            offset += n + int(pad)
        need = sum(_numel(s) for s in names.values()) + sum(int(p) for p in pads)
        if not 0 <= flat.numel() - need < slack:
            raise CheckpointError(
                f"{ranks[0].where}: param group {g}'s partitions hold {flat.numel()} elements "
                f"over {len(ranks)} ranks, its {len(names)} parameters need {need}: the files "
                "do not match the parameter shapes")
    return out


def partition_size(numel: int, world: int) -> int:
    """Elements of a ZeRO-3 parameter on each rank (the last ones padded)."""
    return -(-numel // world)


def unpartition(pieces: Sequence[torch.Tensor], numel: int) -> torch.Tensor:
    """A ZeRO-3 parameter's ranks' slices -> its ``numel`` elements."""
    flat = torch.cat([p.reshape(-1) for p in pieces])
    if flat.numel() < numel:
        raise CheckpointError(f"the ranks' slices hold {flat.numel()} elements, not {numel}")
    return flat[:numel]


def zero3_params(shapes: Shapes, ranks: Sequence[RankGroups],
                 group_of: Sequence[int]) -> list[Param]:
    """Stage 3 (module docstring): ``shapes[sg]`` names sub-group ``sg``'s
    parameters; ``group_of[sg]`` is its param group."""
    world = len(ranks)
    out = []
    for sg, names in enumerate(shapes):
        sizes = [partition_size(_numel(s), world) for s in names.values()]
        for rank in ranks:
            if rank.flat[sg].numel() != sum(sizes):
                raise CheckpointError(
                    f"{rank.where}: sub-group {sg} holds {rank.flat[sg].numel()} elements, its "
                    f"{len(sizes)} parameters' slices need {sum(sizes)} at {world} ranks: the "
                    "files do not match the parameter shapes")
        flats, states, scalars = _joined(ranks, sg, [sum(sizes)] * world)
        offset = 0
        for (name, shape), size in zip(names.items(), sizes):
            n = _numel(shape)
            master = unpartition([f[offset:offset + size] for f in flats], n)
            state = {k: unpartition([s[k][offset:offset + size] for s in states], n)
                     for k in states[0]}
            out.append(Param(name, tuple(int(s) for s in shape), group_of[sg], master, state,
                             scalars))
            offset += size
    return out


def stage0_params(names: Sequence[Sequence[str]], module: Mapping[str, torch.Tensor],
                  optimizer: Mapping[str, Any], where: str) -> list[Param]:
    """Stage 0: ``names[g]`` are group ``g``'s parameters in the order of
    the optimizer's state dict; ``module`` holds their fp32 values."""
    state = optimizer.get("state") or {}
    out, index = [], 0
    for g, group in enumerate(names):
        for name in group:
            value = module[name]
            if value.dtype != torch.float32:
                raise UnsupportedCheckpoint(
                    f"{where}: parameter {name!r} is {value.dtype} at ZeRO stage 0 without "
                    "DeepSpeed's fp16 optimizer: its fp32 master weights are not in the file")
            elementwise, scalars = _split(state.get(index), tuple(value.shape),
                                          f"{where}: parameter {name!r}")
            out.append(Param(name, tuple(value.shape), g, value.detach().reshape(-1).clone(),
                             elementwise, scalars))
            index += 1
    return out
