"""Cutting a consolidated state dict into Hugging Face-style shard files (pure).

DeepSpeed's ``zero_to_fp32`` writes ``pytorch_model.bin`` (or
``model.safetensors``) when the weights fit in ``max_shard_size``, else
``pytorch_model-00001-of-0000N.bin`` ... plus ``pytorch_model.bin.index.json``
(``model.safetensors.index.json``): ``{"metadata": {"total_size": BYTES},
"weight_map": {key: file}}``. It takes the cut from
``huggingface_hub.split_torch_state_dict_into_shards``; :func:`plan_shards`
makes the same cut from names, sizes and tied names alone, so the files
can be written one tensor at a time:

* keys are taken in state-dict order; a key whose storage was seen before
  (a tied weight) joins its first name's shard and adds no bytes;
* a tensor larger than the limit gets a shard of its own, placed before
  the shard being filled;
* otherwise a shard is closed when the next tensor would take it past the
  limit (so a shard may exceed it only by being one oversized tensor).

Sizes are decimal as in huggingface_hub (``"5GB"`` = 5 * 10**9 bytes);
binary units (``"5GiB"``) and plain integers (bytes) are accepted too.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Optional, Union

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*$")


def parse_size(size: Union[int, str]) -> int:
    """Bytes in ``size``: an integer, or a number with a unit (``"5GB"``, ``"500MiB"``)."""
    if isinstance(size, bool):
        raise ValueError(f"max_shard_size must be a size such as '5GB', got {size!r}")
    if isinstance(size, int):
        value = size
    else:
        match = _SIZE.match(str(size))
        unit = match.group(2).upper() if match else None
        if match is None or unit not in _UNITS:
            raise ValueError(f"max_shard_size {size!r} is not a size: write a number of bytes "
                             "or a number with a unit (KB, MB, GB, TB, KiB, MiB, GiB, TiB)")
        value = int(float(match.group(1)) * _UNITS[unit])
    if value <= 0:
        raise ValueError(f"max_shard_size must be positive, got {size!r}")
    return value


@dataclass(frozen=True)
class Shard:
    """One output file and the state-dict keys it holds, in order."""

    file: str
    keys: tuple[str, ...]


def weights_name(safetensors: bool) -> str:
    return "model.safetensors" if safetensors else "pytorch_model.bin"


def index_name(safetensors: bool) -> str:
    return weights_name(safetensors) + ".index.json"


def _shard_file(name: str, index: int, count: int) -> str:
    stem, dot, ext = name.rpartition(".")
    return f"{stem}-{index + 1:05d}-of-{count:05d}{dot}{ext}"


def plan_shards(order: Sequence[str], nbytes: Mapping[str, int], aliases: Mapping[str, str],
                max_bytes: Optional[int], safetensors: bool) -> list[Shard]:
    """The shard files for keys ``order`` (module docstring); ``nbytes`` of
    each stored tensor, ``aliases`` a tied key -> the key it shares storage
    with; ``max_bytes`` None: one file."""
    name = weights_name(safetensors)
    if max_bytes is None:
        return [Shard(name, tuple(order))]
    shards: list[list[str]] = []
    current: list[str] = []
    size = 0
    home: dict[str, list[str]] = {}  # storage -> the shard list holding it
    for key in order:
        storage = aliases.get(key, key)
        if storage in home:
            home[storage].append(key)
            continue
        tensor = nbytes[storage]
        if tensor > max_bytes:
            shards.append([key])
            home[storage] = shards[-1]
            continue
        if size + tensor > max_bytes and current:
            shards.append(current)
            current, size = [], 0
        current.append(key)
        size += tensor
        home[storage] = current
    if current:
        shards.append(current)
    if len(shards) <= 1:
        return [Shard(name, tuple(order))]
    return [Shard(_shard_file(name, i, len(shards)), tuple(keys)) for i, keys in enumerate(shards)]


def index_json(shards: Sequence[Shard], total_size: int) -> str:
    """The index file's text (huggingface_hub's layout and formatting)."""
    weight_map = {key: shard.file for shard in shards for key in shard.keys}
    body = {"metadata": {"total_size": total_size}, "weight_map": weight_map}
    return json.dumps(body, indent=2, sort_keys=True) + "\n"
