"""ZeRO partitioning maths: which rank owns which elements (pure, no torch).

A parameter group's *trainable* parameters, flattened and concatenated in
order, form the group's **flat buffer**. It is padded with zeros at the end
to a multiple of ``world_size * alignment`` elements and cut into
``world_size`` contiguous, equal **partitions**; rank ``r`` owns
``[r * P, (r + 1) * P)`` where ``P = padded_numel // world_size``.

A :class:`Piece` names one contiguous run of elements that lies both inside
one parameter and inside one range of the flat buffer: ``length`` elements
starting at ``param_offset`` in the flattened parameter ``param`` and at
``flat_offset`` in the flat buffer.

Invariants (checked by property tests):

* the pieces of all ranks cover every element of every trainable parameter
  exactly once, and nothing else;
* padding (``padded_numel - numel`` elements) lies only at the end of the
  flat buffer; no piece touches it;
* all partitions have the same size ``P`` (a multiple of ``alignment``);
* frozen parameters (``trainable`` False) and empty parameters own no flat
  elements: they have no offset and appear in no piece;
* a group with no trainable elements has ``padded_numel == 0`` and
  partitions of size 0.

Also here: :func:`plan_buckets` (consecutive items packed under a size cap)
and :func:`windows` (a range cut into equal chunks), used to bound the
memory of the collectives.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Optional


@dataclass(frozen=True)
class Piece:
    """``length`` elements of parameter ``param`` (its index in the group),
    from ``param_offset`` in the flattened parameter and ``flat_offset`` in
    the group's flat buffer."""

    param: int
    param_offset: int
    flat_offset: int
    length: int

    def shifted(self, origin: int) -> Piece:
        """The same piece with ``flat_offset`` measured from ``origin``
        (e.g. a rank's partition start: then it indexes the rank's shard)."""
        return Piece(self.param, self.param_offset, self.flat_offset - origin, self.length)


def _check_int(name: str, value: int, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")


@dataclass(frozen=True)
class GroupLayout:
    """Flat layout and partitioning of one parameter group (module docstring).

    ``numels`` lists every parameter of the group in order, frozen ones too,
    so that piece indices are indices into the group's own parameter list;
    ``trainable[i]`` False excludes parameter ``i`` from the flat buffer.
    """

    numels: tuple[int, ...]
    world_size: int
    alignment: int = 1
    trainable: Optional[tuple[bool, ...]] = None
    offsets: tuple[Optional[int], ...] = field(init=False)
    numel: int = field(init=False)
    padded_numel: int = field(init=False)
    partition_numel: int = field(init=False)
    _starts: tuple[int, ...] = field(init=False, repr=False, compare=False)
    _members: tuple[int, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        _check_int("world_size", self.world_size, 1)
        _check_int("alignment", self.alignment, 1)
        object.__setattr__(self, "numels", tuple(self.numels))
        for i, numel in enumerate(self.numels):
            _check_int(f"numels[{i}]", numel, 0)
        mask = (True,) * len(self.numels) if self.trainable is None else tuple(self.trainable)
        if len(mask) != len(self.numels):
            raise ValueError(f"trainable has {len(mask)} entries for {len(self.numels)} numels")
        object.__setattr__(self, "trainable", mask)
        offsets: list[Optional[int]] = []
        starts: list[int] = []
        members: list[int] = []
        total = 0
        for i, (numel, keep) in enumerate(zip(self.numels, mask)):
            if keep and numel > 0:
                offsets.append(total)
                starts.append(total)
                members.append(i)
                total += numel
            else:
                offsets.append(None)
        quantum = self.world_size * self.alignment
        padded = -(-total // quantum) * quantum
        object.__setattr__(self, "offsets", tuple(offsets))
        object.__setattr__(self, "numel", total)
        object.__setattr__(self, "padded_numel", padded)
        object.__setattr__(self, "partition_numel", padded // self.world_size)
        object.__setattr__(self, "_starts", tuple(starts))
        object.__setattr__(self, "_members", tuple(members))

    @property
    def padding(self) -> int:
        return self.padded_numel - self.numel

    @property
    def members(self) -> tuple[int, ...]:
        """Indices of the parameters that have flat elements, in flat order."""
        return self._members

    def rank_range(self, rank: int) -> tuple[int, int]:
        """``[start, end)`` of ``rank``'s partition in the flat buffer."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside world size {self.world_size}")
        start = rank * self.partition_numel
        return start, start + self.partition_numel

    def owner(self, flat_index: int) -> int:
        """The rank whose partition holds ``flat_index``."""
        if not 0 <= flat_index < self.padded_numel:
            raise ValueError(f"flat index {flat_index} outside [0, {self.padded_numel})")
        return flat_index // self.partition_numel

    def pieces_in_range(self, start: int, end: int) -> tuple[Piece, ...]:
        """The pieces of trainable parameters inside flat ``[start, end)``,
        in flat order (padding yields nothing)."""
        if not 0 <= start <= end <= self.padded_numel:
            raise ValueError(f"range [{start}, {end}) outside [0, {self.padded_numel}]")
        out: list[Piece] = []
        k = max(bisect.bisect_right(self._starts, start) - 1, 0)
        while k < len(self._starts) and self._starts[k] < end:
            index = self._members[k]
            lo = max(start, self._starts[k])
            hi = min(end, self._starts[k] + self.numels[index])
            if hi > lo:
                out.append(Piece(index, lo - self._starts[k], lo, hi - lo))
            k += 1
        return tuple(out)

    def pieces(self, rank: int) -> tuple[Piece, ...]:
        """The pieces ``rank`` owns; ``flat_offset`` counts from the start of
        the flat buffer (``piece.shifted(start)`` indexes the rank's shard)."""
        return self.pieces_in_range(*self.rank_range(rank))

    def param_owners(self, index: int) -> tuple[tuple[int, int, int], ...]:
        """``(rank, param_offset, length)`` for every rank holding part of
        parameter ``index``, in rank order (empty for frozen/empty ones)."""
        offset = self.offsets[index]
        if offset is None:
            return ()
        out = []
        end = offset + self.numels[index]
        position = offset
        while position < end:
            rank = self.owner(position)
            stop = min(end, (rank + 1) * self.partition_numel)
            out.append((rank, position - offset, stop - position))
            position = stop
        return tuple(out)


def partition_group(numels: Sequence[int], world_size: int, alignment: int = 1,
                    trainable: Optional[Sequence[bool]] = None) -> GroupLayout:
    """The layout of one group (see :class:`GroupLayout`)."""
    return GroupLayout(tuple(numels), world_size, alignment,
                       None if trainable is None else tuple(bool(t) for t in trainable))


def partition_groups(groups: Sequence[Sequence[int]], world_size: int, alignment: int = 1,
                     trainable: Optional[Sequence[Sequence[bool]]] = None
                     ) -> tuple[GroupLayout, ...]:
    """One independent layout per parameter group, in order."""
    if trainable is not None and len(trainable) != len(groups):
        raise ValueError(f"trainable has {len(trainable)} groups for {len(groups)} groups")
    return tuple(partition_group(numels, world_size, alignment,
                                 None if trainable is None else trainable[g])
                 for g, numels in enumerate(groups))


def plan_buckets(sizes: Sequence[int], cap: int) -> tuple[tuple[int, ...], ...]:
    """Pack items ``0..len(sizes)-1``, in order, into buckets of consecutive
    items whose sizes sum to at most ``cap``; an item bigger than ``cap`` is
    alone in its bucket. Every index appears exactly once, in order."""
    _check_int("cap", cap, 1)
    buckets: list[tuple[int, ...]] = []
    current: list[int] = []
    used = 0
    for index, size in enumerate(sizes):
        _check_int(f"sizes[{index}]", size, 0)
        if current and used + size > cap:
            buckets.append(tuple(current))
            current, used = [], 0
        current.append(index)
        used += size
    if current:
        buckets.append(tuple(current))
    return tuple(buckets)


def windows(total: int, size: int) -> tuple[tuple[int, int], ...]:
    """``[start, end)`` chunks of ``[0, total)`` of ``size`` elements (the
    last may be shorter); none when ``total`` is 0."""
    _check_int("total", total, 0)
    _check_int("size", size, 1)
    return tuple((start, min(start + size, total)) for start in range(0, total, size))
