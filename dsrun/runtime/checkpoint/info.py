"""``dsrun checkpoint info``: what a checkpoint directory holds (no torch).

:func:`checkpoint_info` reads only JSON (the manifest) and file sizes, so it
answers in milliseconds on any machine: the tags present in natural order
(and which one ``latest`` names, and saves that never finished, with how
to remove them), and for one tag who
saved it (world size, ZeRO stage, precision, versions), the training
position, the number of parameters and tensors, the optimizer and its
state, and the sizes on disk and of the fp32 model.
"""

from __future__ import annotations

import os
import shlex
from dataclasses import dataclass, field
from typing import Any, Optional

from dsrun.errors import CheckpointError
from dsrun.runtime.checkpoint.from_deepspeed_kinds import deepspeed_tag_advice
from dsrun.runtime.checkpoint.manifest import (
    ITEMSIZE,
    MANIFEST,
    TMP_SUFFIX,
    VALUE,
    Manifest,
    parse_manifest,
)
from dsrun.runtime.checkpoint.tags import list_tags, read_latest, tag_dir


@dataclass(frozen=True)
class TagInfo:
    tag: str
    path: str
    manifest: Manifest
    disk_bytes: int

    def summary(self) -> dict[str, Any]:
        m = self.manifest
        params = [e for e in m.tensors.values() if e.kind == "param"]
        trained = [e for e in params if e.group is not None]
        largest = max(m.tensors.values(), key=lambda e: e.numel, default=None)
        fp32 = sum(e.numel * (4 if _floating(e.items[VALUE].dtype) else
                              ITEMSIZE.get(e.items[VALUE].dtype, 4))
                   for e in m.tensors.values())
        return {
            "tag": self.tag, "path": self.path, "world_size": m.world_size,
            "zero_stage": m.meta.get("zero_stage"), "precision": m.meta.get("precision"),
            "global_steps": m.meta.get("global_steps"),
            "global_samples": m.meta.get("global_samples"),
            "skipped_steps": m.meta.get("skipped_steps"), "created": m.meta.get("created"),
            "pipeline": m.meta.get("pipeline"),
            "dsrun_version": m.meta.get("dsrun_version"),
            "torch_version": m.meta.get("torch_version"),
            "parameters": sum(e.numel for e in params),
            "trainable_parameters": sum(e.numel for e in trained),
            "parameter_tensors": len(params),
            "buffers": len(m.tensors) - len(params), "tied": dict(m.aliases),
            "optimizer": m.optimizer, "optimizer_state": m.state_keys,
            "param_groups": len(m.param_groups),
            "lr": [g.get("lr") for g in m.param_groups],
            "disk_bytes": self.disk_bytes, "fp32_model_bytes": fp32,
            "largest_tensor": None if largest is None else
            {"name": largest.name, "shape": list(largest.shape), "elements": largest.numel},
            "files": len(m.files) + 1,
            "imported_from": m.meta.get("imported_from"),
            "dp_world_size": m.meta.get("dp_world_size"),
            "unplaced_aliases": list(m.meta.get("unplaced_aliases") or ()),
        }


def size_texts(*sizes: int) -> list[str]:
    """``sizes`` (bytes) in the unit of the largest, with as many decimals
    as it takes for different sizes to read differently (a message that
    says "needs 0.4 MiB, 0.4 MiB are free" is not true on its face)."""
    top = max(sizes, default=0)
    unit, scale = next(((u, f) for u, f in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10))
                        if top >= f), ("bytes", 1))
    for places in range(1 if scale > 1 else 0, 7 if scale > 1 else 1):
        texts = [f"{n / scale:,.{places}f} {unit}" for n in sizes]
        if len(set(texts)) == len(set(sizes)):
            return texts
    return [f"{n:,} bytes" for n in sizes]


def human_bytes(n: int) -> str:
    return size_texts(n)[0]


def _floating(dtype: str) -> bool:
    return dtype.startswith(("float", "bfloat"))


@dataclass(frozen=True)
class DirInfo:
    root: str
    tags: list[str]
    interrupted: list[str]
    latest: Optional[str]
    selected: Optional[TagInfo] = None
    notes: list[str] = field(default_factory=list)


def _disk_bytes(path: str) -> int:
    total = 0
    for name in os.listdir(path):
        try:
            total += os.stat(os.path.join(path, name)).st_size
        except OSError:
            pass
    return total


def _tag_info(tag: str, path: str) -> TagInfo:
    manifest_path = os.path.join(path, MANIFEST)
    try:
        with open(manifest_path, encoding="utf-8") as f:
            text = f.read()
    except OSError as exc:
        raise CheckpointError(f"cannot read {manifest_path}: {exc}") from None
    return TagInfo(tag, path, parse_manifest(text, manifest_path), _disk_bytes(path))


def checkpoint_info(checkpoint_dir: str, tag: Optional[str] = None) -> DirInfo:
    """What ``checkpoint_dir`` (a save directory, or one tag's directory) holds."""
    root = os.path.abspath(checkpoint_dir)
    if not os.path.isdir(root):
        raise CheckpointError(f"the checkpoint directory {root} does not exist")
    if tag is None and os.path.exists(os.path.join(root, MANIFEST)):
        name = os.path.basename(root)
        return DirInfo(os.path.dirname(root), [name], [], None, _tag_info(name, root))
    advice = deepspeed_tag_advice(root, tag)
    if advice is not None:
        raise CheckpointError(advice)
    tags, interrupted = list_tags(root)
    notes = []
    try:
        latest = read_latest(root)
    except CheckpointError as exc:
        latest, notes = None, [str(exc)]
    if latest is not None and latest not in tags:
        notes.append(f"'latest' names {latest!r}, which is not a complete checkpoint here")
    chosen = tag if tag is not None else (latest if latest in tags else
                                          (tags[-1] if tags else None))
    if chosen is None:
        if not tags and latest is not None and os.path.isdir(os.path.join(root, latest)):
            tag_dir(root, latest)  # raises, saying what it holds (a DeepSpeed checkpoint?)
        if not tags:
            raise CheckpointError(f"{root} holds no dsrun checkpoint (no tag directory with a "
                                  f"{MANIFEST})" + (f"; interrupted saves: "
                                                    f"{', '.join(interrupted)}" if interrupted
                                                    else ""))
        return DirInfo(root, tags, interrupted, latest, None, notes)
    return DirInfo(root, tags, interrupted, latest,
                   _tag_info(chosen, tag_dir(root, chosen)), notes)


def format_info(info: DirInfo) -> list[str]:
    """The lines ``dsrun checkpoint info`` prints."""
    lines = [f"checkpoint directory {info.root}"]
    if info.tags:
        marked = [f"{t} (latest)" if t == info.latest else t for t in info.tags]
        lines.append(f"tags: {', '.join(marked)}")
    if info.interrupted:
        lines.append(f"interrupted saves (not loadable): {', '.join(info.interrupted)} - a later "
                     "save removes them once unchanged for checkpoint.timeout, or remove them: "
                     + shlex.join(["rm", "-r", *(os.path.join(info.root, t + TMP_SUFFIX)
                                                 for t in info.interrupted)]))
    lines.extend(f"note: {n}" for n in info.notes)
    if info.selected is None:
        return lines
    s = info.selected.summary()
    source = s["imported_from"]
    if isinstance(source, dict):  # dsrun checkpoint from-deepspeed: who saved it is DeepSpeed
        who = (f"imported {s['created'] or '?'} from a DeepSpeed "
               f"{source.get('deepspeed_version', '?')} checkpoint saved by "
               f"{s['dp_world_size'] or '?'} rank(s)")
    else:
        who = f"saved {s['created'] or '?'} by {s['world_size']} rank(s)"
    lines.append(f"tag {s['tag']}: {who}, ZeRO stage {s['zero_stage']}, {s['precision']}, "
                 f"dsrun {s['dsrun_version']}, torch {s['torch_version']}")
    if s["unplaced_aliases"]:
        lines.append("  left out by the import (second names of ambiguous look-alike modules; "
                     "a consolidated state dict lacks them: load it with strict=False): "
                     + ", ".join(s["unplaced_aliases"]))
    pipe = s["pipeline"]
    if isinstance(pipe, dict):
        lines.append(f"  pipeline: {pipe.get('stages')} stage(s) x {pipe.get('replicas')} "
                     f"replica(s), layer boundaries {pipe.get('parts')} (loads into any "
                     "number of stages or replicas)")
    lines.append(f"  step {s['global_steps']} ({s['global_samples']} samples, "
                 f"{s['skipped_steps']} skipped)")
    lines.append(f"  parameters: {s['parameters']:,} in {s['parameter_tensors']} tensors "
                 f"({s['trainable_parameters']:,} trained); {s['buffers']} buffers"
                 + (f"; tied: {', '.join(f'{a} = {b}' for a, b in s['tied'].items())}"
                    if s["tied"] else ""))
    if s["optimizer"]:
        state = ", ".join(s["optimizer_state"]) or "none yet"
        lines.append(f"  optimizer: {s['optimizer']} ({s['param_groups']} param group(s), lr "
                     f"{', '.join(f'{lr:g}' for lr in s['lr'] if isinstance(lr, (int, float)))}"
                     f"); state: {state}")
    big = s["largest_tensor"]
    lines.append(f"  size: {human_bytes(s['disk_bytes'])} on disk in {s['files']} files; "
                 f"fp32 model {human_bytes(s['fp32_model_bytes'])}"
                 + (f"; largest tensor {big['name']} {big['shape']} "
                    f"({human_bytes(big['elements'] * 4)} in fp32)" if big else ""))
    return lines
