"""Loading, at any world size and ZeRO stage: intersect, verify, then install.

:func:`load_state` is the Python API (the engine calls it through
:mod:`.engine_io`)::

    1. agree      every rank resolves the same tag (``latest`` when none is
                  given; no ``latest`` and no tag: nothing to load); ranks
                  that read different ``latest`` files are named, by host
    2. match      each source's prepare_import() names the ranges this rank
                  needs; the manifest is read and its names and shapes
                  compared with the union of what all ranks declare:
                  strict - one error listing every difference; not strict -
                  the intersection, with a warning listing what is skipped;
                  ranks that read different manifests (a digest of each:
                  node-local copies that differ) are refused, by host
    3. read       every file is checked against the sizes the manifest
                  records; each rank reads the chunks that intersect its
                  ranges (whole chunks, so every byte it uses is checked
                  against its crc32) into the sources' staging tensors
    4. check      each source's check_import() builds the optimizer state
                  it will install and checks it (nothing changes yet)
                  and the caller's ``prepare`` turns what was read into
                  what it returns (the client state), which may refuse it
    5. install    only when every rank read everything without error:
                  finish_import() on every source (collective at ZeRO
                  stages); otherwise every rank raises the same error, naming
                  the missing, truncated or corrupt file, and nothing changed

Resharding is step 3: the chunks are flat element ranges of each tensor
without padding, so a rank of any new layout finds the elements it owns
wherever they were saved.
"""

from __future__ import annotations

import io
import json
import logging
import os
import socket
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

from dsrun.errors import CheckpointError
from dsrun.runtime.checkpoint.chunk_reader import ChunkReader
from dsrun.runtime.checkpoint.coord import Coordinator, check_same, raise_failures
from dsrun.runtime.checkpoint.fragments import SCALAR_STATE, ImportPlan, StateSource
from dsrun.runtime.checkpoint.manifest import (
    ENGINE_STATE,
    MANIFEST,
    VALUE,
    Manifest,
    TensorEntry,
    decode_number,
    parse_manifest,
    record_file,
)
from dsrun.runtime.checkpoint.sharing import (
    describe_manifest,
    different_checkpoints,
    different_latest,
    manifest_digest,
    missing_on_some,
)
from dsrun.runtime.checkpoint.storage import read_file, torch_dtype
from dsrun.runtime.checkpoint.tags import read_latest, tag_dir

log = logging.getLogger("dsrun.runtime.checkpoint")
MAX_LISTED = 12


@dataclass(frozen=True)
class LoadRequest:
    load_dir: str
    tag: Optional[str] = None
    strict: bool = True
    optimizer_states: bool = True
    model_aliases: Mapping[str, str] = field(default_factory=dict)
    # step 4 on every rank, before anything is installed: the caller's
    # reading of the engine state (Loaded.prepared); raising refuses the load
    prepare: Optional[Callable[[Loaded], Any]] = None


@dataclass
class Loaded:
    """What a load found besides the tensors (already installed)."""

    path: str
    manifest: Manifest
    engine_state: Optional[dict[str, Any]]
    record: Mapping[str, Any]        # this rank's saved extras (rank 0's if it did not save)
    saved_rank: int                  # the rank whose record that is
    skipped: list[str]
    prepared: Any = None             # what LoadRequest.prepare made of it


def _listing(names: Sequence[str]) -> str:
    shown = ", ".join(names[:MAX_LISTED])
    return shown + (f", ... ({len(names) - MAX_LISTED} more)" if len(names) > MAX_LISTED else "")


@dataclass(frozen=True)
class Differences:
    missing: list[str]       # in the model, not in the checkpoint
    unexpected: list[str]    # in the checkpoint, not in the model
    shapes: list[str]        # in both, different shapes ("name: ckpt [..] vs model [..]")
    # the missing ones the save left out (exclude_frozen_parameters=True): a
    # strict load refuses them too, as DeepSpeed's does ("Missing key(s)")
    excluded: list[str] = field(default_factory=list)

    @property
    def skipped(self) -> list[str]:
        return [*self.missing, *self.unexpected, *(s.split(":")[0] for s in self.shapes)]

    @property
    def only_excluded(self) -> bool:
        """Only the frozen parameters the save left out differ."""
        return bool(self.missing) and self.missing == self.excluded \
            and not self.unexpected and not self.shapes

    def describe(self) -> str:
        parts = []
        if self.missing:
            why = ""
            if self.excluded:
                why = (f" ({'all' if self.missing == self.excluded else len(self.excluded)} "
                       "frozen when saved and left out by save_checkpoint("
                       "exclude_frozen_parameters=True))")
            parts.append(f"missing from the checkpoint ({len(self.missing)}): "
                         f"{_listing(self.missing)}{why}")
        if self.unexpected:
            parts.append(f"not in the model ({len(self.unexpected)}): "
                         f"{_listing(self.unexpected)}")
        if self.shapes:
            parts.append(f"different shapes ({len(self.shapes)}): {_listing(self.shapes)}")
        return "; ".join(parts)


def compare(manifest: Manifest, declared: Mapping[str, Sequence[int]],
            model_aliases: Mapping[str, str]) -> Differences:
    """Names and shapes of the model (``declared``: name -> shape, over all
    ranks) against the checkpoint's (pure)."""
    left_out = set(manifest.meta.get("excluded_frozen") or ())
    missing = [n for n in declared if n not in manifest.tensors and n not in manifest.aliases]
    excluded = [n for n in missing if n in left_out]
    unexpected = [n for n in manifest.tensors if n not in declared and n not in model_aliases]
    shapes = [f"{n}: checkpoint {list(e.shape)} vs model {list(declared[n])}"
              for n, e in manifest.tensors.items()
              if n in declared and tuple(e.shape) != tuple(declared[n])]
    return Differences(sorted(missing), sorted(unexpected), sorted(shapes), sorted(excluded))


def _scalar(value: Any) -> Any:
    if isinstance(value, dict) and "tensor" in value:
        return torch.tensor(decode_number(value["value"]), dtype=torch_dtype(value["tensor"]))
    return decode_number(value)


def decode_groups(groups: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for group in groups:
        clean = {}
        for key, value in group.items():
            if isinstance(value, dict) and "unsupported" in value:
                continue
            clean[key] = [_scalar(v) for v in value] if isinstance(value, list) else _scalar(value)
            if isinstance(clean[key], torch.Tensor):
                clean[key] = clean[key].item()
        out.append(clean)
    return out


def _read_checked(path: str, manifest: Manifest, name: str) -> bytes:
    data = read_file(os.path.join(path, name), name)
    info = manifest.files.get(name, {})
    if "crc32" in info and zlib.crc32(data) != info["crc32"]:
        raise CheckpointError(f"{os.path.join(path, name)} is corrupt: its checksum does not "
                              "match the manifest")
    return data


def legacy_state(entry: TensorEntry) -> list[str]:
    """Per-element optimizer state of a 0-d tensor (Adam's moments) that
    checkpoints of earlier dsrun versions stored among its scalars, as 0-d
    tensors like ``step``: told apart by the rule saves use now
    (:func:`~.fragments.per_element`)."""
    if tuple(entry.shape) != ():
        return []
    return [k for k, v in entry.scalars.items()
            if isinstance(v, dict) and "tensor" in v and k not in SCALAR_STATE]


def _fill_targets(reader: ChunkReader, manifest: Manifest, plan: ImportPlan,
                  skip: set[str]) -> None:
    for target in plan.targets:
        entry = manifest.tensors.get(target.name)
        if entry is None or target.name in skip:
            continue
        reader.fill(entry, VALUE, entry.items[VALUE], target, target.value)
        scalars = {k: _scalar(v) for k, v in entry.scalars.items()}
        legacy = legacy_state(entry)
        for key in list(target.state):
            if key in entry.items:
                reader.fill(entry, key, entry.items[key], target, target.state[key])
            elif key in legacy:
                target.state[key].copy_(scalars[key].reshape(1))
            else:
                del target.state[key]
        target.scalars.update({k: v for k, v in scalars.items() if k not in legacy})
        target.loaded = True


def _state_keys(manifest: Manifest) -> list[str]:
    """The per-element optimizer state the checkpoint has (old 0-d ones too)."""
    keys = dict.fromkeys(manifest.state_keys)
    for entry in manifest.tensors.values():
        keys.update(dict.fromkeys(legacy_state(entry)))
    return list(keys)


def without_state(manifest: Manifest, plans: Sequence[ImportPlan], skip: set[str]) -> list[str]:
    """Trainable tensors the checkpoint has no optimizer state for (frozen
    when it was saved): they start with fresh state. Empty when it has
    state for none (saved before the first step)."""
    def stateless(entry: TensorEntry) -> bool:
        return set(entry.items) == {VALUE} and not entry.scalars

    if all(stateless(e) for e in manifest.tensors.values()):
        return []
    return sorted({name for plan in plans for name, info in plan.tensors.items()
                   if info.group is not None and name not in skip
                   and name in manifest.tensors and stateless(manifest.tensors[name])})


@dataclass
class _Phase:
    """Per-rank results of the local steps, before the ranks compare notes."""

    path: str = ""
    manifest: Optional[Manifest] = None
    plans: list[ImportPlan] = field(default_factory=list)
    declared: dict[str, list[int]] = field(default_factory=dict)
    digest: str = ""   # of the manifest's bytes: which checkpoint this rank read
    what: str = ""     # describe_manifest: how to tell it from another


def _open(request: LoadRequest, tag: str, sources: Sequence[StateSource],
          names: Mapping[int, str]) -> _Phase:
    phase = _Phase(path=tag_dir(os.path.abspath(request.load_dir), tag))
    manifest_path = os.path.join(phase.path, MANIFEST)
    text = read_file(manifest_path, "the manifest")
    phase.manifest = parse_manifest(text.decode(errors="replace"), manifest_path)
    phase.digest = manifest_digest(text)
    phase.what = describe_manifest(phase.path, phase.manifest)
    keys = _state_keys(phase.manifest) if request.optimizer_states else None
    phase.plans = [source.prepare_import(names, keys) for source in sources]
    saved = phase.manifest.optimizer
    for plan in phase.plans:
        for info in plan.tensors.values():
            phase.declared[info.name] = list(info.shape)
        if keys and saved and plan.optimizer and plan.optimizer != saved:
            raise CheckpointError(
                f"the checkpoint's optimizer state is {saved}'s, this engine's optimizer is "
                f"{plan.optimizer}: pass load_optimizer_states=False to load the weights only")
    return phase


def _resolve(request: LoadRequest) -> tuple[Optional[str], Optional[str]]:
    """(tag, problem) on this rank."""
    root = os.path.abspath(request.load_dir)
    if not os.path.isdir(root):
        if os.path.exists(root):
            return request.tag, f"the checkpoint directory {root} is not a directory"
        if request.tag is None:  # a resume-if-there-is-one before the first save (DeepSpeed)
            return None, None
        return request.tag, f"the checkpoint directory {root} does not exist"
    if request.tag is not None:
        return str(request.tag), None
    try:
        return read_latest(root), None
    except CheckpointError as exc:
        return None, str(exc)


def _agree_tag(request: LoadRequest, root: str, coord: Coordinator
               ) -> tuple[Optional[str], list[str]]:
    """Step 1: (the tag every rank resolved, every rank's host); ranks that
    found different ``latest`` files, or the directory on some hosts only,
    are named with their hosts."""
    tag, problem = _resolve(request)
    asked = None if request.tag is None else str(request.tag)
    everyone = coord.agree("engine.load_checkpoint()", {
        "tag": tag, "problem": problem, "asked": asked, "host": socket.gethostname(),
        "found": os.path.isdir(root)})
    hosts = [e.get("host", "?") for e in everyone]
    problems = [e["problem"] for e in everyone]
    _raise_failures(problems, "loading a checkpoint",
                    missing_on_some(problems, [bool(e.get("found")) for e in everyone],
                                    hosts, root))
    tags = [e["tag"] for e in everyone]
    if any(t != tags[0] for t in tags) and all(e.get("asked") is None for e in everyone):
        raise CheckpointError(different_latest(tags, hosts, root))
    check_same(tags, "the checkpoint tag to load")
    return tag, hosts


def load_state(request: LoadRequest, sources: Sequence[StateSource], names: Mapping[int, str],
               coord: Coordinator) -> Optional[Loaded]:
    """A load (module docstring); None when there is nothing to load (no
    tag given and no ``latest``), as DeepSpeed. Every rank must call it."""
    root = os.path.abspath(request.load_dir)
    tag, hosts = _agree_tag(request, root, coord)
    if tag is None:
        log.warning("no tag given and no 'latest' file in %s%s: nothing loaded", root,
                    "" if os.path.isdir(root) else " (the directory does not exist)")
        return None
    phase, status = _Phase(), None
    try:
        phase = _open(request, tag, sources, names)
    except CheckpointError as exc:
        status = str(exc)
    notes = coord.exchange({"error": status, "declared": phase.declared,
                            "digest": phase.digest, "what": phase.what})
    errors = [n["error"] for n in notes]
    _raise_failures(errors, f"loading checkpoint {tag!r}",
                    missing_on_some(errors, [e is None for e in errors], hosts, root))
    mixed = different_checkpoints(tag, notes, hosts, root)
    if mixed:
        raise CheckpointError(mixed)
    declared: dict[str, list[int]] = {}
    for note in notes:
        declared.update(note["declared"])
    assert phase.manifest is not None
    diff = compare(phase.manifest, declared, request.model_aliases)
    if diff.skipped and request.strict:
        keep = " (the model keeps its own values for what the checkpoint lacks)"
        raise CheckpointError(f"checkpoint {phase.path} does not match the model: "
                              f"{diff.describe()}. Pass load_module_strict=False to load what "
                              f"both have{keep if diff.missing else ''}")
    if diff.skipped and coord.rank == 0:
        # expected when the save left the frozen parameters out on purpose
        (log.info if diff.only_excluded else log.warning)(
            "load_module_strict=False: skipped %s", diff.describe())
    result, status = None, None
    try:
        result = _read(request, phase, set(diff.skipped), coord.rank)
        if request.prepare is not None:
            result.prepared = request.prepare(result)
    except CheckpointError as exc:
        status = str(exc)
    except OSError as exc:
        status = f"reading {phase.path} failed: {exc}"
    except Exception as exc:  # noqa: BLE001 - e.g. an engine state that does not unpickle
        status = f"reading {phase.path} failed: {type(exc).__name__}: {exc}"
    raise_failures(coord.exchange(status), f"loading checkpoint {phase.path}")
    assert result is not None
    groups = decode_groups(phase.manifest.param_groups) if request.optimizer_states else None
    _check(sources, phase.plans, groups, request.optimizer_states, coord, phase.path)
    fresh = without_state(phase.manifest, phase.plans, set(diff.skipped))
    if fresh and request.optimizer_states and coord.rank == 0:
        log.info("the checkpoint has no optimizer state for %d trainable parameters (frozen "
                 "when it was saved?): they start with fresh optimizer state: %s",
                 len(fresh), _listing(fresh))
    for source, plan in zip(sources, phase.plans):
        source.finish_import(plan, groups, request.optimizer_states)
    saved = phase.manifest.world_size
    log.info("loaded checkpoint %s (saved by %d rank%s)", phase.path, saved,
             "" if saved == 1 else "s")
    return result


def _raise_failures(statuses: Sequence[Optional[str]], what: str, hint: str) -> None:
    """:func:`~.coord.raise_failures`, with ``hint`` (why some ranks only) after it."""
    try:
        raise_failures(statuses, what)
    except CheckpointError as exc:
        raise CheckpointError(f"{exc}{hint}") from None


def _check(sources: Sequence[StateSource], plans: Sequence[ImportPlan],
           groups: Optional[list[dict[str, Any]]], optimizer_states: bool,
           coord: Coordinator, path: str) -> None:
    """Every source's ``check_import`` (where it has one), then the same
    error on every rank if any failed: nothing has changed yet."""
    status = None
    try:
        for source, plan in zip(sources, plans):
            check = getattr(source, "check_import", None)
            if check is not None:
                check(plan, groups, optimizer_states)
    except Exception as exc:  # noqa: BLE001 - e.g. the optimizer refusing the state
        status = f"{type(exc).__name__}: {exc}"
    raise_failures(coord.exchange(status), f"loading checkpoint {path}")


def _read(request: LoadRequest, phase: _Phase, skip: set[str], rank: int) -> Loaded:
    assert phase.manifest is not None
    manifest = phase.manifest
    reader = ChunkReader(phase.path, manifest)
    try:
        reader.check_sizes()
        for plan in phase.plans:
            _fill_targets(reader, manifest, plan, skip)
    except BaseException:
        reader.abandon()
        raise
    reader.close()
    blob = None
    if os.path.exists(os.path.join(phase.path, ENGINE_STATE)) or ENGINE_STATE in manifest.files:
        blob = _read_checked(phase.path, manifest, ENGINE_STATE)
    saved_rank = rank if rank < manifest.world_size else 0
    record = json.loads(_read_checked(phase.path, manifest, record_file(saved_rank)))
    # To host memory, as DeepSpeed loads it: rank 0 wrote it, so its CUDA tensors
    # (client_state's) would otherwise go to rank 0's device on every rank.
    state = torch.load(io.BytesIO(blob), map_location="cpu", weights_only=False) \
        if blob is not None else None
    return Loaded(phase.path, manifest, state, record.get("extra") or {}, saved_rank,
                  [] if not skip else sorted(skip))

