"""Streaming writers of whole state dicts: torch.save's format and safetensors.

Both take the list of tensors (name, shape, dtype) up front and then the
tensors one at a time, in that order, so a consolidation holds one tensor in
memory, never the whole model.

* :class:`TorchSaveWriter` writes what ``torch.save(OrderedDict)`` writes: a
  zip archive (stored, not compressed) with ``archive/data.pkl`` - a pickle
  whose tensors are ``torch._utils._rebuild_tensor_v2`` calls over
  persistent storage ids - and one ``archive/data/<key>`` record per storage,
  each aligned to 64 bytes as torch aligns them. Since the pickle only refers
  to storages by key, it is written first, before any tensor exists.
  ``torch.load`` (``weights_only=True`` too) reads it; a name listed in
  ``aliases`` shares its target's storage, as tied weights do in
  ``torch.save``.
* :class:`SafetensorsWriter` writes the safetensors format (an 8-byte
  header length, a JSON header of dtypes, shapes and byte ranges, then the
  data). The format has no shared tensors: an alias gets its own copy.
  dsrun writes it itself; the ``safetensors`` package is only needed to
  read it.

Both write a temporary file of their own (``tempfile.mkstemp``) beside the
file ``PATH`` names - through symlinks, as ``torch.save`` writes through
them - and rename it over that file on :meth:`close`, so a reader sees the
old file or the new one, and no other file is touched (``abort`` removes
only its own temporary file). The new file keeps the old one's mode, or
gets the umask's default as ``torch.save``'s would. Refusing an output that
is not a regular file is the caller's check, before any work
(:func:`~dsrun.runtime.checkpoint.consolidate.check_output`).
"""

from __future__ import annotations

import collections
import contextlib
import io
import json
import os
import pickle
import struct
import zipfile
from collections.abc import Mapping, Sequence
from typing import Any, BinaryIO, NamedTuple

import torch

from dsrun.atomicfile import AtomicFile
from dsrun.runtime.checkpoint.storage import tensor_bytes

ALIGN = 64
_SAFETENSORS_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL", torch.complex64: "C64",
}


class Spec(NamedTuple):
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n * self.dtype.itemsize


def _contiguous_stride(shape: Sequence[int]) -> tuple[int, ...]:
    stride, out = 1, []
    for size in reversed(shape):
        out.append(stride)
        stride *= max(size, 1)
    return tuple(reversed(out))


class _Storage:
    def __init__(self, key: str, dtype: torch.dtype, numel: int) -> None:
        self.key, self.dtype, self.numel = key, dtype, numel


class _Tensor:
    """Pickles like a CPU tensor over a :class:`_Storage`."""

    def __init__(self, storage: _Storage, shape: tuple[int, ...]) -> None:
        self.storage, self.shape = storage, shape

    def __reduce_ex__(self, protocol: Any) -> Any:
        return (torch._utils._rebuild_tensor_v2,
                (self.storage, 0, self.shape, _contiguous_stride(self.shape), False,
                 collections.OrderedDict()))


class _Pickler(pickle.Pickler):
    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, _Storage):
            kind = getattr(torch, torch.storage._dtype_to_storage_type_map()[obj.dtype])
            return ("storage", kind, obj.key, "cpu", obj.numel)
        return None


class TorchSaveWriter:
    """``torch.save(OrderedDict(...))``, one tensor at a time (module docstring)."""

    def __init__(self, path: str, specs: Sequence[Spec], aliases: Mapping[str, str],
                 order: Sequence[str]) -> None:
        self.path, self.specs = path, list(specs)
        self.archive = os.path.splitext(os.path.basename(path))[0] or "archive"
        self.output = AtomicFile(path)
        try:
            self.zip = zipfile.ZipFile(self.output.file, "w", zipfile.ZIP_STORED,
                                       allowZip64=True)
        except BaseException:
            self.output.abort()
            raise
        self.keys = {s.name: i for i, s in enumerate(self.specs)}
        self.written: set[str] = set()
        storages = {s.name: _Storage(str(i), s.dtype, s.nbytes // s.dtype.itemsize)
                    for i, s in enumerate(self.specs)}
        tensors = {s.name: _Tensor(storages[s.name], s.shape) for s in self.specs}
        state = collections.OrderedDict()
        for name in order:
            state[name] = tensors[aliases.get(name, name)]
        buffer = io.BytesIO()
        _Pickler(buffer, protocol=2).dump(state)
        self._record("data.pkl", buffer.getvalue())
        self._record("byteorder", b"little")

    def _record(self, name: str, data: bytes) -> None:
        info = self._info(f"{self.archive}/{name}", len(data))
        with self.zip.open(info, "w") as out:
            out.write(data)

    def _info(self, name: str, size: int) -> zipfile.ZipInfo:
        """A stored entry whose data starts at a multiple of ALIGN bytes."""
        info = zipfile.ZipInfo(name, date_time=(1980, 1, 1, 0, 0, 0))
        info.compress_type = zipfile.ZIP_STORED
        info.file_size = size
        fixed = 30 + len(name.encode()) + (20 if size > zipfile.ZIP64_LIMIT else 0) + 4
        pad = (-(self.zip.fp.tell() + fixed)) % ALIGN  # type: ignore[union-attr]
        info.extra = struct.pack("<HH", 0x4246, pad) + b"Z" * pad
        return info

    def write(self, tensor: torch.Tensor, name: str) -> None:
        """Tensor ``name`` (a spec's name; any order), cast to its spec's dtype."""
        key = self.keys[name]
        spec = self.specs[key]
        data = tensor.detach().to("cpu", spec.dtype).contiguous()
        if data.numel() * data.element_size() != spec.nbytes or name in self.written:
            raise ValueError(f"{name}: got {tuple(data.shape)} (written before: "
                             f"{name in self.written}), want {spec.shape} once")
        with self.zip.open(self._info(f"{self.archive}/data/{key}", spec.nbytes), "w") as out:
            out.write(tensor_bytes(data))
        self.written.add(name)

    def close(self) -> None:
        if len(self.written) != len(self.specs):
            raise ValueError(f"{len(self.specs) - len(self.written)} tensors were not written")
        self._record("version", b"3\n")
        self.zip.close()
        self.output.finish()

    def abort(self) -> None:
        with contextlib.suppress(Exception):
            self.zip.close()
        self.output.abort()


class SafetensorsWriter:
    """The safetensors format, one tensor at a time (module docstring)."""

    def __init__(self, path: str, specs: Sequence[Spec], aliases: Mapping[str, str],
                 order: Sequence[str]) -> None:
        by_name = {s.name: s for s in specs}
        self.path = path
        self.order = [(name, by_name[aliases.get(name, name)]) for name in order]
        header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
        offset = 0
        for name, spec in self.order:
            if spec.dtype not in _SAFETENSORS_DTYPES:
                raise ValueError(f"{name}: dtype {spec.dtype} has no safetensors name")
            header[name] = {"dtype": _SAFETENSORS_DTYPES[spec.dtype], "shape": list(spec.shape),
                            "data_offsets": [offset, offset + spec.nbytes]}
            offset += spec.nbytes
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)
        self.output = AtomicFile(path)
        self.file: BinaryIO = self.output.file
        try:
            self.file.write(struct.pack("<Q", len(text)) + text)
        except BaseException:
            self.output.abort()
            raise
        self.pending: dict[str, list[str]] = {}
        for name, spec in self.order:
            self.pending.setdefault(spec.name, []).append(name)
        self.written: set[str] = set()
        self.cache: dict[str, torch.Tensor] = {}

    def write(self, tensor: torch.Tensor, name: str) -> None:
        """Tensor ``name`` (a spec's name); its aliases are written with it
        when they come next in order, else kept until their turn."""
        self.cache[name] = tensor.detach().to("cpu").contiguous()
        self._flush()

    def _flush(self) -> None:
        while len(self.written) < len(self.order):
            alias, spec = self.order[len(self.written)]
            data = self.cache.get(spec.name)
            if data is None:
                return
            self.file.write(tensor_bytes(data.to(spec.dtype)))
            self.written.add(alias)
            self.pending[spec.name].remove(alias)
            if not self.pending[spec.name]:
                del self.cache[spec.name]

    def close(self) -> None:
        if len(self.written) != len(self.order):
            raise ValueError(f"{len(self.order) - len(self.written)} tensors were not written")
        self.output.finish()

    def abort(self) -> None:
        self.output.abort()

