"""A plain state dict from a checkpoint: ``dsrun checkpoint to-fp32`` and
``dsrun.utils.zero_to_fp32``.

Everything here streams: for one tensor at a time it reads the chunks of
its value (checking each crc32), converts floating-point values to fp32
(integer buffers keep their dtype), hands it to the output and drops it.
Peak memory is about the largest tensor (twice it when that tensor was
saved in 16 bits), whatever the size of the model. Optimizer state is not
read. Keys are in the order of the saving model's ``state_dict()``, tied
weights under every name, so ``model.load_state_dict(torch.load(OUT))``
accepts it.

* :func:`to_fp32` writes one file (:mod:`.stateformats`: torch.save's
  format, or safetensors);
* :func:`write_shards` writes DeepSpeed's ``zero_to_fp32`` output: one file,
  or Hugging Face-style shard files of at most ``max_shard_size`` and their
  index (:mod:`.shards`), each shard written and closed before the next
  (at most two are open: a tensor larger than the limit gets its own);
* :func:`get_fp32_state_dict` returns the dict in memory (DeepSpeed's
  ``get_fp32_state_dict_from_zero_checkpoint``), or with ``lazy`` a dict of
  :class:`LazyTensor` that each read their tensor when asked.

The output is checked before any tensor is read: its directory must exist
(one named with a trailing separator is created) and be writable, and an
existing output must be a regular file (a symlink is written through, to
the file it names; a FIFO, device, socket or directory is refused), else a
:class:`~dsrun.errors.CheckpointError` names it and nothing is written; a
write that fails later (a full disk) removes its own temporary file (never
another file) and raises one too.

``exclude_frozen`` leaves out the parameters frozen when the checkpoint was
saved (the manifest's ``frozen`` meta; in older checkpoints, the parameters
in no optimizer param group) and their tied names. Bad input - no checkpoint
directory, no ``latest`` and no tag, a missing, truncated or corrupt file -
raises :class:`~dsrun.errors.CheckpointError` naming it.

A DeepSpeed import (:mod:`.from_deepspeed`) may have left out stage-3
second names it could not place (the manifest's ``unplaced_aliases``
meta): the state dict then lacks them, as DeepSpeed's own ``zero_to_fp32``
output does, and a warning names them - a strict ``load_state_dict``
reports them missing; ``strict=False`` leaves them to the model's ties.
"""

from __future__ import annotations

import collections
import logging
import os
import stat
from collections.abc import Collection, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Optional, Union

import torch

from dsrun.errors import CheckpointError
from dsrun.runtime.checkpoint.fragments import LoadTarget
from dsrun.runtime.checkpoint.from_deepspeed_kinds import deepspeed_tag_advice
from dsrun.runtime.checkpoint.manifest import MANIFEST, VALUE, Manifest, TensorEntry, parse_manifest
from dsrun.runtime.checkpoint.reader import ChunkReader
from dsrun.runtime.checkpoint.shards import Shard, index_json, index_name, parse_size, plan_shards
from dsrun.runtime.checkpoint.stateformats import SafetensorsWriter, Spec, TorchSaveWriter
from dsrun.runtime.checkpoint.storage import atomic_write, read_file, torch_dtype
from dsrun.runtime.checkpoint.tags import read_latest, tag_dir

log = logging.getLogger("dsrun.runtime.checkpoint")


@dataclass(frozen=True)
class Consolidated:
    path: str
    tensors: int
    bytes: int
    largest: str
    largest_bytes: int


@dataclass(frozen=True)
class ShardedOutput:
    """What :func:`write_shards` wrote: its files (in shard order), the index
    (None for one file), the number of stored tensors and their bytes."""

    files: list[str]
    index: Optional[str]
    tensors: int
    bytes: int


def open_checkpoint(checkpoint_dir: str, tag: Optional[str] = None) -> tuple[str, Manifest]:
    """(tag directory, manifest) of ``checkpoint_dir`` - a save directory
    (``tag``, else ``latest``) or a tag's directory itself."""
    root = os.path.abspath(checkpoint_dir)
    if not os.path.isdir(root):
        raise CheckpointError(f"the checkpoint directory {root} does not exist")
    if tag is None and os.path.exists(os.path.join(root, MANIFEST)):
        path = root
    else:
        advice = deepspeed_tag_advice(root, tag)
        if advice is not None:
            raise CheckpointError(advice)
        if tag is None:
            tag = read_latest(root)
            if tag is None:
                raise CheckpointError(f"{root} has no 'latest' file and no tag was given "
                                      "(--tag): name the tag to use")
        path = tag_dir(root, str(tag))
    manifest_path = os.path.join(path, MANIFEST)
    text = read_file(manifest_path, "the manifest").decode(errors="replace")
    manifest = parse_manifest(text, manifest_path)
    unplaced = manifest.meta.get("unplaced_aliases")
    if unplaced:
        log.warning("%s: the state dict lacks %s: second names of parameters that the DeepSpeed "
                    "import could not place (ambiguous look-alike modules); load it with "
                    "model.load_state_dict(sd, strict=False), which reports them as missing "
                    "and leaves them to the model's ties", path, ", ".join(map(repr, unplaced)))
    return path, manifest


def _fp32(entry: TensorEntry, floating: torch.dtype = torch.float32) -> torch.dtype:
    """The output dtype of ``entry``: ``floating`` for floating-point values."""
    stored = torch_dtype(entry.items[VALUE].dtype)
    return floating if stored.is_floating_point else stored


def frozen_names(manifest: Manifest) -> set[str]:
    """Parameters frozen (``requires_grad`` False) when the checkpoint was
    saved, as DeepSpeed decides, and their tied names. Checkpoints from
    before the manifest recorded them: parameters in no param group."""
    recorded = manifest.meta.get("frozen")
    if recorded is not None:
        frozen = set(recorded) & set(manifest.tensors)
    else:
        frozen = {n for n, e in manifest.tensors.items()
                  if e.kind == "param" and e.group is None}
    return frozen | {alias for alias, target in manifest.aliases.items() if target in frozen}


def state_dict_order(manifest: Manifest, exclude: Collection[str] = ()) -> list[str]:
    """Every key of the consolidated state dict (tied names too), in the
    saving model's ``state_dict()`` order, without ``exclude``."""
    order = list(manifest.meta.get("state_dict_keys") or ())
    known = set(manifest.tensors) | set(manifest.aliases)
    order = [n for n in order if n in known]
    for name in [*manifest.tensors, *manifest.aliases]:
        if name not in order:
            order.append(name)
    return [n for n in order if n not in exclude]


def _read(reader: ChunkReader, entry: TensorEntry) -> torch.Tensor:
    """One tensor's value in fp32 (integers as stored), checked."""
    item = entry.items[VALUE]
    value = torch.empty(entry.numel, dtype=torch_dtype(item.dtype))
    reader.fill(entry, VALUE, item, LoadTarget(entry.name, 0, entry.numel, value), value)
    reader.verify()
    return value.to(_fp32(entry)).view(entry.shape)


def iter_tensors(path: str, manifest: Manifest, exclude: Collection[str] = ()
                 ) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, fp32 value)`` of every stored tensor, one at a time, in
    state-dict order (tied names are not repeated)."""
    reader = ChunkReader(path, manifest)
    try:
        reader.check_sizes()
        for name in state_dict_order(manifest, exclude):
            entry = manifest.tensors.get(name)
            if entry is not None:  # else an alias: its target is read under its own name
                yield name, _read(reader, entry)
    finally:
        reader.abandon()


def _not_a_directory(path: str) -> Optional[str]:
    """The nearest existing one of ``path`` and its parents, when that is
    not a directory (what stops ``path`` from being created)."""
    path = os.path.abspath(path)
    while not os.path.lexists(path):
        parent = os.path.dirname(path)
        if parent == path:
            return None
        path = parent
    return None if os.path.isdir(path) else path


def make_output_dir(directory: str) -> None:
    """Create ``directory`` (and its parents) for the output, or raise
    CheckpointError saying why it cannot be."""
    try:
        os.makedirs(directory, exist_ok=True)
    except OSError as exc:
        blocker = _not_a_directory(directory)
        reason = f"{blocker} is not a directory" if blocker else exc.strerror or str(exc)
        raise CheckpointError(f"cannot create the output directory {directory}: "
                              f"{reason}") from None


_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"),
          (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"))


def check_output(out: str) -> None:
    """Raise CheckpointError unless file ``out`` can be written (through a
    symlink, into the file it names): an existing ``out`` is a regular file,
    and its directory exists, is one, and is writable. Before any work."""
    try:
        mode = os.stat(out).st_mode
    except (FileNotFoundError, NotADirectoryError):  # a new file; its directory: below
        mode = None
    except OSError as exc:  # a symlink loop, a file used as a directory
        raise CheckpointError(f"cannot write {out}: {exc.strerror or exc}") from None
    if mode is not None and not stat.S_ISREG(mode):
        kind = next((k for test, k in _KINDS if test(mode)), "not a regular file")
        raise CheckpointError(f"cannot write {out}: it is {kind}, not a regular file")
    directory = os.path.dirname(os.path.realpath(out))
    if not os.path.isdir(directory):
        blocker = _not_a_directory(directory)
        shown = directory if os.path.islink(out) else os.path.dirname(out) or os.curdir
        reason = (f"{blocker} is not a directory" if blocker else
                  f"the directory {shown} does not exist")
        raise CheckpointError(f"cannot write {out}: {reason}")
    if not os.access(directory, os.W_OK | os.X_OK):
        raise CheckpointError(f"cannot write {out}: the directory {directory} is not "
                              f"writable")


def _stream(path: str, manifest: Manifest, files: Sequence[tuple[str, Shard]],
            safetensors: bool, floating: torch.dtype, exclude: Collection[str]) -> list[int]:
    """Write each ``(output path, shard)`` from one pass over the tensors:
    a file is opened at its first tensor and closed after its last; returns
    the bytes written per tensor."""
    writer_cls = SafetensorsWriter if safetensors else TorchSaveWriter
    where: dict[str, int] = {}   # stored tensor -> its file
    left: list[int] = []        # stored tensors not written yet, per file
    for f, (_, shard) in enumerate(files):
        stored = [k for k in shard.keys if k in manifest.tensors]
        where.update({k: f for k in stored})
        left.append(len(stored))
    writers: dict[int, Any] = {}
    sizes: list[int] = []
    current = [files[0][0] if files else ""]  # the file being written, for errors

    def writer(f: int) -> Any:
        current[0] = files[f][0]
        if f not in writers:
            out, shard = files[f]
            specs = [Spec(k, tuple(manifest.tensors[k].shape), _fp32(manifest.tensors[k], floating))
                     for k in shard.keys if k in manifest.tensors]
            aliases = {k: v for k, v in manifest.aliases.items() if k in shard.keys}
            writers[f] = writer_cls(out, specs, aliases, list(shard.keys))
        return writers[f]

    try:
        for f, count in enumerate(left):
            if count == 0:  # nothing stored (an empty model): the file still exists
                writer(f)
                writers.pop(f).close()
        for name, value in iter_tensors(path, manifest, exclude):
            f = where[name]
            writer(f).write(value, name)
            sizes.append(value.numel() * _fp32(manifest.tensors[name], floating).itemsize)
            del value
            left[f] -= 1
            if left[f] == 0:
                writers.pop(f).close()
    except BaseException as exc:
        for open_writer in writers.values():
            open_writer.abort()
        if isinstance(exc, OSError):  # reading raises CheckpointError: this is the output
            raise CheckpointError(f"writing {current[0]} failed: "
                                  f"{exc.strerror or exc}") from None
        raise
    return sizes


def to_fp32(checkpoint_dir: str, out: str, tag: Optional[str] = None,
            safetensors: bool = False, exclude_frozen: bool = False) -> Consolidated:
    """Write the checkpoint's weights as one fp32 state dict file (module
    docstring); ``out`` may be a directory (``pytorch_model.bin`` or
    ``model.safetensors`` inside it), also one that does not exist yet when
    it ends with a path separator (created, as ``cp`` and ``rsync`` read a
    trailing ``/``)."""
    path, manifest = open_checkpoint(checkpoint_dir, tag)
    if out.endswith(tuple(sep for sep in (os.sep, os.altsep) if sep)):
        make_output_dir(out)
    if os.path.isdir(out):
        out = os.path.join(out, "model.safetensors" if safetensors else "pytorch_model.bin")
    check_output(out)
    exclude = frozen_names(manifest) if exclude_frozen else set()
    order = state_dict_order(manifest, exclude)
    shard = Shard(os.path.basename(out), tuple(order))
    sizes = _stream(path, manifest, [(os.path.abspath(out), shard)], safetensors,
                    torch.float32, exclude)
    stored = [n for n in order if n in manifest.tensors]
    largest = max(zip(stored, sizes), key=lambda x: x[1], default=("", -1))
    log.info("wrote %s: %d tensors, %.1f MiB", out, len(stored), sum(sizes) / 2**20)
    return Consolidated(os.path.abspath(out), len(stored), sum(sizes), largest[0], largest[1])


def write_shards(checkpoint_dir: str, out_dir: str, tag: Optional[str] = None, *,
                 safetensors: bool = False, exclude_frozen: bool = False,
                 max_shard_size: Union[int, str, None] = None,
                 dtype: torch.dtype = torch.float32) -> ShardedOutput:
    """DeepSpeed's ``zero_to_fp32`` output in ``out_dir`` (module docstring):
    floating-point tensors in ``dtype``, one file or shards of at most
    ``max_shard_size`` with their index (None: one file)."""
    limit = None if max_shard_size is None else parse_size(max_shard_size)
    path, manifest = open_checkpoint(checkpoint_dir, tag)
    exclude = frozen_names(manifest) if exclude_frozen else set()
    order = state_dict_order(manifest, exclude)
    nbytes = {n: e.numel * _fp32(e, dtype).itemsize for n, e in manifest.tensors.items()}
    shards = plan_shards(order, nbytes, manifest.aliases, limit, safetensors)
    make_output_dir(out_dir)
    files = [(os.path.abspath(os.path.join(out_dir, s.file)), s) for s in shards]
    index = os.path.abspath(os.path.join(out_dir, index_name(safetensors)))
    for out in [index, *(f for f, _ in files)]:
        check_output(out)
    target = os.path.realpath(index)  # written through a symlink, as the shards are
    if os.path.exists(target):  # a previous run's: it would name files this run may not write
        os.unlink(target)
    sizes = _stream(path, manifest, files, safetensors, dtype, exclude)
    total = sum(sizes)
    if len(shards) > 1:
        atomic_write(target, index_json(shards, total).encode())
    log.info("wrote %d file(s) in %s: %d tensors, %.1f MiB", len(files), out_dir, len(sizes),
             total / 2**20)
    return ShardedOutput([f for f, _ in files], index if len(shards) > 1 else None,
                         len(sizes), total)


class LazyTensor:
    """One tensor of a checkpoint, read (and checked) when :meth:`contiguous`
    is called - DeepSpeed's lazy-mode pseudo tensor. Each call reads it
    again; nothing is cached."""

    def __init__(self, path: str, manifest: Manifest, name: str) -> None:
        self._path, self._manifest = path, manifest
        self._entry = manifest.tensors[name]
        self.shape = torch.Size(self._entry.shape)
        self.dtype = _fp32(self._entry)

    def contiguous(self) -> torch.Tensor:
        reader = ChunkReader(self._path, self._manifest)
        try:
            value = _read(reader, self._entry)
        except BaseException:
            reader.abandon()
            raise
        reader.close()
        return value

    def numel(self) -> int:
        return self._entry.numel

    def __repr__(self) -> str:
        return f"LazyTensor({self._entry.name!r}, shape={list(self.shape)}, dtype={self.dtype})"


def get_fp32_state_dict(checkpoint_dir: str, tag: Optional[str] = None,
                        exclude_frozen: bool = False, lazy: bool = False
                        ) -> collections.OrderedDict[str, Any]:
    """The checkpoint's weights as an fp32 state dict in memory (tied
    weights share one tensor); ``lazy``: :class:`LazyTensor` values (tied
    names share one), every file checked to be there and of the recorded size."""
    path, manifest = open_checkpoint(checkpoint_dir, tag)
    exclude = frozen_names(manifest) if exclude_frozen else set()
    order = state_dict_order(manifest, exclude)
    if lazy:
        reader = ChunkReader(path, manifest)
        try:
            reader.check_sizes()
        finally:
            reader.abandon()
        values: dict[str, Any] = {n: LazyTensor(path, manifest, n)
                                  for n in order if n in manifest.tensors}
    else:
        values = dict(iter_tensors(path, manifest, exclude))
    return collections.OrderedDict(
        (name, values[manifest.aliases.get(name, name)]) for name in order)
