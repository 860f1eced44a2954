"""Per-rank save records and their merge into the manifest (pure, no torch).

Each rank that saves writes ``rank_RRRRR.json`` next to its data file: the
tensors its sources declare, the chunks it wrote (name, item, dtype, byte
offset, element range, crc32), the optimizer scalars and hyperparameters
it holds, and its own RNG states and data position. Rank 0 merges every
record into the :class:`~.manifest.Manifest` (:func:`merge_records`), which
fails - naming the tensor - when the ranks disagree on a tensor's shape or
dtype, or when their chunks do not cover a tensor exactly.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

from dsrun.errors import CheckpointError
from dsrun.runtime.checkpoint.manifest import (
    VALUE,
    Chunk,
    Item,
    Manifest,
    TensorEntry,
    check_coverage,
    coverage_gaps,
    rank_file,
)


@dataclass(frozen=True)
class ChunkRecord:
    name: str
    item: str
    dtype: str
    offset: int
    start: int
    end: int
    crc: int

    def to_json(self) -> list[Any]:
        return [self.name, self.item, self.dtype, self.offset, self.start, self.end, self.crc]


@dataclass(frozen=True)
class RankRecord:
    """What one rank saved (module docstring)."""

    rank: int
    bytes: int
    tensors: Mapping[str, Mapping[str, Any]]   # name -> shape, dtype, kind, group
    chunks: tuple[ChunkRecord, ...]
    scalars: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    groups: tuple[Mapping[str, Any], ...] = ()
    optimizer: Optional[str] = None
    files: Mapping[str, Mapping[str, int]] = field(default_factory=dict)
    extra: Mapping[str, Any] = field(default_factory=dict)   # rng, data position, ...

    def to_json(self) -> dict[str, Any]:
        return {"rank": self.rank, "bytes": self.bytes, "tensors": dict(self.tensors),
                "chunks": [c.to_json() for c in self.chunks], "scalars": dict(self.scalars),
                "groups": list(self.groups), "optimizer": self.optimizer,
                "files": dict(self.files), "extra": dict(self.extra)}

    @classmethod
    def from_json(cls, raw: Mapping[str, Any], where: str) -> RankRecord:
        try:
            return cls(int(raw["rank"]), int(raw["bytes"]), dict(raw["tensors"]),
                       tuple(ChunkRecord(str(c[0]), str(c[1]), str(c[2]), *map(int, c[3:]))
                             for c in raw["chunks"]),
                       dict(raw.get("scalars") or {}), tuple(raw.get("groups") or ()),
                       raw.get("optimizer"), dict(raw.get("files") or {}),
                       dict(raw.get("extra") or {}))
        except (KeyError, TypeError, ValueError, IndexError) as exc:
            raise CheckpointError(f"{where}: malformed rank record ({exc})") from None


def _declarations(records: Sequence[RankRecord]) -> dict[str, Mapping[str, Any]]:
    declared: dict[str, Mapping[str, Any]] = {}
    for record in records:
        for name, info in record.tensors.items():
            seen = declared.setdefault(name, info)
            if list(seen["shape"]) != list(info["shape"]) or seen["kind"] != info["kind"]:
                raise CheckpointError(
                    f"ranks disagree on tensor {name!r}: shape {list(seen['shape'])} "
                    f"({seen['kind']}) vs {list(info['shape'])} ({info['kind']}) on rank "
                    f"{record.rank}; every rank must build the same model")
    return declared


def merge_records(records: Sequence[RankRecord], tag: str, files: Mapping[str, Mapping[str, int]],
                  meta: Mapping[str, Any], aliases: Mapping[str, str]) -> Manifest:
    """The manifest of a save whose ranks wrote ``records`` (module docstring)."""
    declared = _declarations(records)
    chunks: dict[tuple[str, str], list[Chunk]] = {}
    dtypes: dict[tuple[str, str], str] = {}
    for record in records:
        for c in record.chunks:
            if c.name not in declared:
                raise CheckpointError(f"rank {record.rank} wrote tensor {c.name!r}, which no "
                                      "rank declared")
            key = (c.name, c.item)
            if dtypes.setdefault(key, c.dtype) != c.dtype:
                raise CheckpointError(f"tensor {c.name!r} ({c.item}) was written as "
                                      f"{dtypes[key]} and as {c.dtype} (rank {record.rank})")
            chunks.setdefault(key, []).append(Chunk(record.rank, c.offset, c.start, c.end, c.crc))
    tensors = {}
    for name, info in declared.items():
        items = {item: Item(dtypes[(n, item)], tuple(cs))
                 for (n, item), cs in chunks.items() if n == name}
        items.setdefault(VALUE, Item(str(info["dtype"]), ()))
        scalars = next((r.scalars[name] for r in records if name in r.scalars), {})
        entry = TensorEntry(name, tuple(info["shape"]), str(info["dtype"]), str(info["kind"]),
                            info.get("group"), items, scalars)
        _check_complete(entry)
        tensors[name] = entry
    first = next((r for r in records if r.groups or r.optimizer), None)
    all_files = dict(files)
    for record in records:
        all_files[rank_file(record.rank)] = {"bytes": record.bytes}
        all_files.update(record.files)
    manifest = Manifest(tag, len(records), tensors, all_files, dict(meta), dict(aliases),
                        first.groups if first else (), first.optimizer if first else None)
    for entry in tensors.values():
        check_coverage(entry, all_files, "the new manifest")
    return manifest


def _check_complete(entry: TensorEntry) -> None:
    for key, item in entry.items.items():
        gaps = coverage_gaps([(c.start, c.end) for c in item.chunks], entry.numel)
        if gaps:
            a, b = gaps[0]
            raise CheckpointError(f"no rank wrote elements [{a}, {b}) of tensor {entry.name!r} "
                                  f"({key}): the save is incomplete")
