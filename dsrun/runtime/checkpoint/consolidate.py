"""A plain fp32 state dict from a checkpoint: ``dsrun checkpoint to-fp32``.

:func:`to_fp32` streams: for one tensor at a time it reads the chunks of
its value (checking each crc32), converts floating-point values to fp32
(integer buffers keep their dtype), writes it to the output
(:mod:`.stateformats`: torch.save's format, or safetensors) and drops it.
Peak memory is about the largest tensor (twice it when that tensor was
saved in 16 bits), whatever the size of the model. Optimizer state is not
read. Keys are in the order of the saving model's ``state_dict()``, tied
weights under every name, so ``model.load_state_dict(torch.load(OUT))``
accepts it.

:func:`get_fp32_state_dict` returns the same dict in memory (DeepSpeed's
``get_fp32_state_dict_from_zero_checkpoint``).
"""

from __future__ import annotations

import collections
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Optional

import torch

from dsrun.errors import CheckpointError
from dsrun.runtime.checkpoint.fragments import LoadTarget
from dsrun.runtime.checkpoint.manifest import MANIFEST, VALUE, Manifest, TensorEntry, parse_manifest
from dsrun.runtime.checkpoint.reader import ChunkReader
from dsrun.runtime.checkpoint.stateformats import SafetensorsWriter, Spec, TorchSaveWriter
from dsrun.runtime.checkpoint.storage import read_file, torch_dtype
from dsrun.runtime.checkpoint.tags import read_latest, tag_dir

log = logging.getLogger("dsrun.runtime.checkpoint")


@dataclass(frozen=True)
class Consolidated:
    path: str
    tensors: int
    bytes: int
    largest: str
    largest_bytes: int


def open_checkpoint(checkpoint_dir: str, tag: Optional[str] = None) -> tuple[str, Manifest]:
    """(tag directory, manifest) of ``checkpoint_dir`` - a save directory
    (``tag``, else ``latest``) or a tag's directory itself."""
    root = os.path.abspath(checkpoint_dir)
    if not os.path.isdir(root):
        raise CheckpointError(f"the checkpoint directory {root} does not exist")
    if tag is None and os.path.exists(os.path.join(root, MANIFEST)):
        path = root
    else:
        if tag is None:
            tag = read_latest(root)
            if tag is None:
                raise CheckpointError(f"{root} has no 'latest' file and no tag was given "
                                      "(--tag): name the tag to use")
        path = tag_dir(root, str(tag))
    manifest_path = os.path.join(path, MANIFEST)
    text = read_file(manifest_path, "the manifest").decode(errors="replace")
    return path, parse_manifest(text, manifest_path)


def _fp32(entry: TensorEntry) -> torch.dtype:
    stored = torch_dtype(entry.items[VALUE].dtype)
    return torch.float32 if stored.is_floating_point else stored


def _order(manifest: Manifest) -> list[str]:
    order = list(manifest.meta.get("state_dict_keys") or ())
    known = set(manifest.tensors) | set(manifest.aliases)
    order = [n for n in order if n in known]
    for name in [*manifest.tensors, *manifest.aliases]:
        if name not in order:
            order.append(name)
    return order


def iter_tensors(path: str, manifest: Manifest) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, fp32 value)`` of every tensor, one at a time, in state-dict order."""
    reader = ChunkReader(path, manifest)
    try:
        reader.check_sizes()
        for name in _order(manifest):
            entry = manifest.tensors.get(name)
            if entry is None:
                continue  # an alias: its target is read under its own name
            item = entry.items[VALUE]
            value = torch.empty(entry.numel, dtype=torch_dtype(item.dtype))
            reader.fill(entry, VALUE, item, LoadTarget(name, 0, entry.numel, value), value)
            reader.verify()
            yield name, value.to(_fp32(entry)).view(entry.shape)
    finally:
        reader.abandon()


def to_fp32(checkpoint_dir: str, out: str, tag: Optional[str] = None,
            safetensors: bool = False) -> Consolidated:
    """Write the checkpoint's weights as one fp32 state dict file (module
    docstring); ``out`` may be a directory (``pytorch_model.bin`` or
    ``model.safetensors`` inside it)."""
    path, manifest = open_checkpoint(checkpoint_dir, tag)
    if os.path.isdir(out):
        out = os.path.join(out, "model.safetensors" if safetensors else "pytorch_model.bin")
    specs = [Spec(n, tuple(e.shape), _fp32(e)) for n, e in manifest.tensors.items()]
    writer_cls = SafetensorsWriter if safetensors else TorchSaveWriter
    writer = writer_cls(os.path.abspath(out), specs, manifest.aliases, _order(manifest))
    total, largest = 0, ("", -1)
    try:
        for name, value in iter_tensors(path, manifest):
            size = value.numel() * value.element_size()
            total += size
            largest = max(largest, (name, size), key=lambda x: x[1])
            writer.write(value, name)
            del value
        writer.close()
    except BaseException:
        writer.abort()
        raise
    log.info("wrote %s: %d tensors, %.1f MiB", out, len(specs), total / 2**20)
    return Consolidated(os.path.abspath(out), len(specs), total, largest[0], largest[1])


def get_fp32_state_dict(checkpoint_dir: str, tag: Optional[str] = None
                        ) -> collections.OrderedDict[str, torch.Tensor]:
    """The checkpoint's weights as an fp32 state dict in memory (tied
    weights share one tensor)."""
    path, manifest = open_checkpoint(checkpoint_dir, tag)
    values = dict(iter_tensors(path, manifest))
    return collections.OrderedDict(
        (name, values[manifest.aliases.get(name, name)]) for name in _order(manifest))
