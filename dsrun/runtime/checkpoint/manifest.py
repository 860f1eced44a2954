"""The checkpoint format: a manifest over per-rank files (pure, no torch).

A checkpoint is a directory ``SAVE_DIR/TAG/``::

    manifest.json        what is where (this module), written last
    rank_00000.bin       rank 0's slices, raw little-endian bytes, back to back
    rank_00000.json      rank 0's record: its chunks, RNG states, data position
    ...                  one .bin and one .json per rank that saved
    engine_state.pt      LR scheduler, loss scaler, optimizer hyperparameters
                         and client_state (torch.save, rank 0)

and ``SAVE_DIR/latest`` holds the newest complete tag (DeepSpeed's file).

The manifest lists every tensor by fully qualified name with its full
shape, dtype, kind (param or buffer) and optimizer param group, and for
each of its **items** - ``value`` (the fp32 master for a trained parameter,
else the tensor itself) and each per-element optimizer state such as
``exp_avg`` - the **chunks** that hold it: ``(rank, byte offset in
rank_RRRRR.bin, start, end, crc32)`` for flat elements ``[start, end)``.
Padding is never stored, so nothing in the format depends on the world
size or ZeRO stage that wrote it: a loader intersects the ranges it wants
with the chunks (:func:`plan_reads`). ``scalars`` hold the rest of a
tensor's optimizer state (Adam's ``step``) JSON-encoded (:func:`encode`).

Invariants (checked by :func:`check_coverage` when a manifest is built and
when it is read): every item's chunks cover ``[0, numel)`` exactly once;
chunk byte ranges lie inside their file, whose size the manifest records.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

from dsrun.errors import CheckpointError

FORMAT = "dsrun-checkpoint"
VERSION = 1
MANIFEST = "manifest.json"
LATEST = "latest"
ENGINE_STATE = "engine_state.pt"
TMP_SUFFIX = ".tmp"
REPLACED_SUFFIX = ".replaced"
# in TAG.tmp/ while a save runs: its id, which every rank reads back (sharing.py)
SAVE_ID = "save_id"
VALUE = "value"

ITEMSIZE: Mapping[str, int] = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "complex64": 8,
    "complex128": 16, "int64": 8, "int32": 4, "int16": 2, "int8": 1, "uint8": 1, "bool": 1,
    "float8_e4m3fn": 1, "float8_e5m2": 1, "uint16": 2, "uint32": 4, "uint64": 8,
}


RANK_PREFIX = "rank_"  # then the rank, 5 digits or more (rank_00007, rank_100000)
DATA_SUFFIX, RECORD_SUFFIX, ERROR_SUFFIX = ".bin", ".json", ".error"


def rank_file(rank: int) -> str:
    return f"{RANK_PREFIX}{rank:05d}{DATA_SUFFIX}"


def record_file(rank: int) -> str:
    return f"{RANK_PREFIX}{rank:05d}{RECORD_SUFFIX}"


def error_file(rank: int) -> str:
    return f"{RANK_PREFIX}{rank:05d}{ERROR_SUFFIX}"


def itemsize(dtype: str, where: str = "") -> int:
    size = ITEMSIZE.get(dtype)
    if size is None:
        raise CheckpointError(f"unknown dtype {dtype!r}{' in ' + where if where else ''}")
    return size


def numel(shape: Sequence[int]) -> int:
    return math.prod(shape) if shape else 1


@dataclass(frozen=True)
class Chunk:
    """Flat elements ``[start, end)`` stored at ``offset`` in rank ``rank``'s file."""

    rank: int
    offset: int
    start: int
    end: int
    crc: int

    def to_json(self) -> list[int]:
        return [self.rank, self.offset, self.start, self.end, self.crc]


@dataclass(frozen=True)
class Item:
    """One stored array of a tensor (its value or one optimizer state)."""

    dtype: str
    chunks: tuple[Chunk, ...]

    def to_json(self) -> dict[str, Any]:
        return {"dtype": self.dtype, "chunks": [c.to_json() for c in self.chunks]}


@dataclass(frozen=True)
class TensorEntry:
    name: str
    shape: tuple[int, ...]
    dtype: str
    kind: str
    group: Optional[int]
    items: Mapping[str, Item]
    scalars: Mapping[str, Any] = field(default_factory=dict)

    @property
    def numel(self) -> int:
        return numel(self.shape)

    def to_json(self) -> dict[str, Any]:
        return {"shape": list(self.shape), "dtype": self.dtype, "kind": self.kind,
                "group": self.group, "scalars": dict(self.scalars),
                "items": {k: v.to_json() for k, v in self.items.items()}}


@dataclass(frozen=True)
class Manifest:
    """The parsed ``manifest.json`` (module docstring)."""

    tag: str
    world_size: int
    tensors: Mapping[str, TensorEntry]
    files: Mapping[str, Mapping[str, int]]
    meta: Mapping[str, Any] = field(default_factory=dict)
    aliases: Mapping[str, str] = field(default_factory=dict)
    param_groups: tuple[Mapping[str, Any], ...] = ()
    optimizer: Optional[str] = None
    version: int = VERSION

    def to_json(self) -> dict[str, Any]:
        return {"format": FORMAT, "version": self.version, "tag": self.tag,
                "world_size": self.world_size, "meta": dict(self.meta),
                "optimizer": self.optimizer, "param_groups": [dict(g) for g in self.param_groups],
                "aliases": dict(self.aliases), "files": {k: dict(v) for k, v in self.files.items()},
                "tensors": {k: v.to_json() for k, v in self.tensors.items()}}

    def dumps(self) -> str:
        return json.dumps(self.to_json(), separators=(",", ":"))

    @property
    def state_keys(self) -> list[str]:
        """Optimizer state items stored for any tensor, in first-seen order."""
        keys: dict[str, None] = {}
        for entry in self.tensors.values():
            for key in entry.items:
                if key != VALUE:
                    keys[key] = None
        return list(keys)


# --------------------------------------------------------------- parsing


def _bad(path: str, what: str) -> CheckpointError:
    return CheckpointError(f"{path}: {what}")


def parse_manifest(text: str, path: str) -> Manifest:
    """The manifest in ``text`` (read from ``path``, for messages), checked."""
    try:
        raw = json.loads(text)
    except ValueError as exc:
        raise _bad(path, f"not valid JSON ({exc}): the file is corrupt") from None
    if not isinstance(raw, dict) or raw.get("format") != FORMAT:
        raise _bad(path, f"not a dsrun checkpoint manifest (no \"format\": \"{FORMAT}\")")
    version = raw.get("version")
    if version != VERSION:
        raise _bad(path, f"checkpoint format version {version!r}; this dsrun reads version "
                         f"{VERSION}: use the dsrun version that wrote it to convert it "
                         "(dsrun checkpoint to-fp32)")
    try:
        tensors = {name: _entry(name, body) for name, body in raw["tensors"].items()}
        manifest = Manifest(
            tag=str(raw["tag"]), world_size=int(raw["world_size"]), tensors=tensors,
            files={str(k): {kk: int(vv) for kk, vv in v.items()} for k, v in raw["files"].items()},
            meta=dict(raw.get("meta") or {}), aliases=dict(raw.get("aliases") or {}),
            param_groups=tuple(raw.get("param_groups") or ()), optimizer=raw.get("optimizer"))
    except (KeyError, TypeError, ValueError) as exc:
        raise _bad(path, f"malformed manifest ({type(exc).__name__}: {exc})") from None
    for entry in manifest.tensors.values():
        check_coverage(entry, manifest.files, path)
    return manifest


def _entry(name: str, body: Mapping[str, Any]) -> TensorEntry:
    items = {key: Item(str(item["dtype"]),
                       tuple(Chunk(*(int(x) for x in c)) for c in item["chunks"]))
             for key, item in body["items"].items()}
    group = body.get("group")
    return TensorEntry(name, tuple(int(s) for s in body["shape"]), str(body["dtype"]),
                       str(body["kind"]), None if group is None else int(group), items,
                       dict(body.get("scalars") or {}))


def check_coverage(entry: TensorEntry, files: Mapping[str, Mapping[str, int]],
                   where: str) -> None:
    """Every item of ``entry`` covers ``[0, numel)`` exactly once, inside its files."""
    for key, item in entry.items.items():
        size = itemsize(item.dtype, f"{where}: {entry.name}.{key}")
        position = 0
        for chunk in sorted(item.chunks, key=lambda c: c.start):
            if chunk.start != position or chunk.end <= chunk.start:
                what = "a gap" if chunk.start > position else "an overlap"
                raise _bad(where, f"tensor {entry.name!r} ({key}) has {what} at element "
                                  f"{min(position, chunk.start)}: the manifest is inconsistent")
            name = rank_file(chunk.rank)
            limit = files.get(name, {}).get("bytes")
            if limit is None or chunk.offset + (chunk.end - chunk.start) * size > limit:
                raise _bad(where, f"tensor {entry.name!r} ({key}) points past the end of "
                                  f"{name}: the manifest is inconsistent")
            position = chunk.end
        if position != entry.numel:
            raise _bad(where, f"tensor {entry.name!r} ({key}) covers {position} of its "
                              f"{entry.numel} elements: the checkpoint is incomplete")


# ------------------------------------------------------------ read plans


@dataclass(frozen=True)
class Read:
    """Read ``chunk`` (whole, to verify its crc) and copy its elements
    ``[lo, hi)`` to the target's elements ``[lo - target_start, ...)``."""

    chunk: Chunk
    lo: int
    hi: int


def plan_reads(item: Item, start: int, end: int) -> list[Read]:
    """The chunks of ``item`` that hold elements of ``[start, end)``, with
    the intersection of each (in element order; they cover it exactly when
    the item passed :func:`check_coverage`)."""
    out = []
    for chunk in sorted(item.chunks, key=lambda c: c.start):
        lo, hi = max(start, chunk.start), min(end, chunk.end)
        if lo < hi:
            out.append(Read(chunk, lo, hi))
    return out


# ------------------------------------------------------- JSON encodings


def encode(value: Any) -> Any:
    """A JSON form of an optimizer scalar or hyperparameter: numbers,
    strings, bools and None as is, tuples and lists element-wise, 0-d
    tensors as ``{"tensor": dtype, "value": x}`` (``tensor_value`` is the
    caller's job: this module has no torch). Anything else becomes
    ``{"unsupported": repr}`` and is skipped on load."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else {"float": repr(value)}
    if isinstance(value, (list, tuple)):
        return [encode(v) for v in value]
    item = getattr(value, "item", None)
    if callable(item) and getattr(value, "dim", lambda: 1)() == 0:
        return {"tensor": str(value.dtype).replace("torch.", ""), "value": encode(item())}
    return {"unsupported": repr(value)}


def decode_number(value: Any) -> Any:
    if isinstance(value, dict) and "float" in value:
        return float(value["float"])
    return value


def coverage_gaps(ranges: Iterable[tuple[int, int]], total: int) -> list[tuple[int, int]]:
    """The parts of ``[0, total)`` no range covers (for messages)."""
    gaps, position = [], 0
    for a, b in sorted(ranges):
        if a > position:
            gaps.append((position, a))
        position = max(position, b)
    if position < total:
        gaps.append((position, total))
    return gaps
