"""DeepSpeed's ``zero_to_fp32``: dsrun checkpoints as plain fp32 state dicts.

The functions and the command take DeepSpeed 0.19.8's arguments and write
its file names, on dsrun's own checkpoint format (any ZeRO stage, any
number of saving ranks); the work is
:mod:`dsrun.runtime.checkpoint.consolidate`'s, which streams one tensor at
a time::

    python -m dsrun.utils.zero_to_fp32 CHECKPOINT_DIR OUTPUT_DIR [-t TAG]
        [--max_shard_size 5GB] [--safe_serialization] [--exclude_frozen_parameters]
    python -m dsrun.utils.zero_to_torch CHECKPOINT_DIR OUTPUT_DIR --dtype bf16 ...

(:mod:`.zero_to_torch`: the same in fp32, fp16 or bf16, DeepSpeed's
``zero_to_torch.py``).

``CHECKPOINT_DIR`` is the directory ``engine.save_checkpoint`` wrote (its
``latest`` names the tag unless ``-t`` does) or a tag's directory itself.
``OUTPUT_DIR`` gets ``pytorch_model.bin`` (``model.safetensors`` with
``--safe_serialization``), or, past ``max_shard_size``,
``pytorch_model-00001-of-0000N.bin`` ... and ``pytorch_model.bin.index.json``
(Hugging Face's layout). Unlike DeepSpeed, neither ``safetensors`` nor
``huggingface_hub`` is needed to write them (dsrun writes both formats
itself; reading safetensors needs the package), and memory stays about one
tensor, not one shard.

Bad input raises :class:`~dsrun.errors.CheckpointError` (the command: its
message and exit status 1) naming the directory, tag or file at fault,
where DeepSpeed raises ``ValueError``/``FileNotFoundError``.
"""

from __future__ import annotations

import argparse
import collections
import logging
import os
import sys
from collections.abc import Mapping, Sequence
from typing import Any, Optional, Union

import torch

from dsrun.errors import DsrunError
from dsrun.runtime.checkpoint.consolidate import (
    LazyTensor,
    ShardedOutput,
    get_fp32_state_dict,
    write_shards,
)
from dsrun.runtime.config import DTYPE_NAMES
from dsrun.runtime.precision import torch_dtype

log = logging.getLogger("dsrun.runtime.checkpoint")

__all__ = [
    "LazyTensor", "convert_zero_checkpoint_to_fp32_state_dict",
    "convert_zero_checkpoint_to_state_dict", "get_fp32_state_dict_from_zero_checkpoint",
    "load_state_dict_from_zero_checkpoint", "to_torch_tensor",
]

# DeepSpeed 0.19.8's output dtype names (zero_to_torch's --dtype choices)
OUTPUT_DTYPE_NAMES = {"float32": torch.float32, "fp32": torch.float32,
                      "float16": torch.float16, "fp16": torch.float16,
                      "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}


def _output_dtype(dtype: Union[str, torch.dtype]) -> torch.dtype:
    name = dtype.lower() if isinstance(dtype, str) else None
    resolved = dtype if name is None else OUTPUT_DTYPE_NAMES.get(name) or (
        torch_dtype(name) if name in DTYPE_NAMES else None)
    if resolved not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"unsupported output dtype {dtype!r}: use float32, float16 or "
                         "bfloat16 (fp32, fp16, bf16)")
    return resolved


def get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir: str, tag: Optional[str] = None,
                                             exclude_frozen_parameters: bool = False,
                                             lazy_mode: bool = False
                                             ) -> collections.OrderedDict[str, Any]:
    """The checkpoint's weights as an fp32 state dict on the CPU, for
    ``model.load_state_dict``; tied weights share one tensor.

    ``exclude_frozen_parameters``: without the parameters no optimizer param
    group updated. ``lazy_mode``: the values are :class:`LazyTensor` objects
    (``shape``, ``dtype``) that read their tensor from disk on
    ``.contiguous()`` - each time, nothing cached - so memory holds only
    what the caller keeps; :func:`to_torch_tensor` turns such a dict into
    tensors (DeepSpeed's lazy mode and its helper).
    """
    return get_fp32_state_dict(checkpoint_dir, tag, exclude_frozen=exclude_frozen_parameters,
                               lazy=lazy_mode)


def to_torch_tensor(state_dict: Mapping[str, Any], return_empty_tensor: bool = False,
                    dtype: Union[str, torch.dtype, None] = None) -> dict[str, torch.Tensor]:
    """Tensors for a (lazy) state dict: shared values stay shared;
    ``return_empty_tensor``: uninitialised ones of the right shape;
    ``dtype``: floating-point values cast to it."""
    floating = None if dtype is None else _output_dtype(dtype)
    out: dict[str, torch.Tensor] = {}
    first: dict[int, str] = {}
    for name, value in state_dict.items():
        if id(value) in first:
            out[name] = out[first[id(value)]]
            continue
        first[id(value)] = name
        cast = floating if floating is not None and value.dtype.is_floating_point else None
        if return_empty_tensor:
            out[name] = torch.empty(value.shape, dtype=cast or value.dtype)
        else:
            tensor = value.contiguous()
            out[name] = tensor.to(cast) if cast is not None else tensor
    return out


def convert_zero_checkpoint_to_state_dict(checkpoint_dir: str, output_dir: str,
                                          dtype: Union[str, torch.dtype] = torch.float32,
                                          max_shard_size: Union[int, str, None] = "5GB",
                                          safe_serialization: bool = False,
                                          tag: Optional[str] = None,
                                          exclude_frozen_parameters: bool = False
                                          ) -> ShardedOutput:
    """Write the checkpoint's weights into ``output_dir`` (module docstring),
    floating-point tensors in ``dtype`` (integer buffers keep theirs);
    ``max_shard_size`` None: one file whatever its size."""
    return write_shards(checkpoint_dir, output_dir, tag, safetensors=safe_serialization,
                        exclude_frozen=exclude_frozen_parameters,
                        max_shard_size=max_shard_size, dtype=_output_dtype(dtype))


def convert_zero_checkpoint_to_fp32_state_dict(checkpoint_dir: str, output_dir: str,
                                               max_shard_size: Union[int, str, None] = "5GB",
                                               safe_serialization: bool = False,
                                               tag: Optional[str] = None,
                                               exclude_frozen_parameters: bool = False
                                               ) -> ShardedOutput:
    """:func:`convert_zero_checkpoint_to_state_dict` in fp32 (DeepSpeed's
    positional order: ``max_shard_size`` third)."""
    return convert_zero_checkpoint_to_state_dict(
        checkpoint_dir, output_dir, torch.float32, max_shard_size, safe_serialization, tag,
        exclude_frozen_parameters)


def load_state_dict_from_zero_checkpoint(model: torch.nn.Module, checkpoint_dir: str,
                                         tag: Optional[str] = None) -> torch.nn.Module:
    """Move ``model`` to the CPU, load the checkpoint's fp32 weights into it
    (``strict=False``, as DeepSpeed) and return it. A model inside an engine
    is no longer usable by that engine afterwards: build a new one."""
    state = get_fp32_state_dict(checkpoint_dir, tag)
    model = model.cpu()
    result = model.load_state_dict(state, strict=False)
    if result.missing_keys or result.unexpected_keys:
        log.warning("load_state_dict_from_zero_checkpoint: missing %s, unexpected %s",
                    result.missing_keys, result.unexpected_keys)
    return model


def arguments(prog: str, description: str, dtype: bool = False) -> argparse.ArgumentParser:
    """The command line of DeepSpeed's ``zero_to_fp32.py`` (``dtype``: and
    ``zero_to_torch.py``'s required ``--dtype``)."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument("checkpoint_dir", help="the directory save_checkpoint wrote "
                        "(with 'latest'), or one tag's directory")
    parser.add_argument("output_dir", help="where to write the state dict file(s)")
    if dtype:
        parser.add_argument("--dtype", choices=sorted(OUTPUT_DTYPE_NAMES), required=True,
                            help="the floating-point tensors' dtype (integers keep theirs)")
    parser.add_argument("--max_shard_size", default="5GB",
                        help="largest file before the output is sharded (default 5GB)")
    parser.add_argument("--safe_serialization", action="store_true",
                        help="write safetensors instead of torch.save's format")
    parser.add_argument("-t", "--tag", default=None,
                        help="the checkpoint tag (default: the one 'latest' names)")
    parser.add_argument("--exclude_frozen_parameters", action="store_true",
                        help="leave out parameters no optimizer param group updated")
    parser.add_argument("-d", "--debug", action="store_true", help="accepted; no effect")
    return parser


def run(args: argparse.Namespace, dtype: torch.dtype) -> int:
    """Convert as ``args`` (:func:`arguments`) say, in ``dtype``: 0, or 1
    with the error on stderr."""
    try:
        done = convert_zero_checkpoint_to_state_dict(
            args.checkpoint_dir, args.output_dir, dtype, max_shard_size=args.max_shard_size,
            safe_serialization=args.safe_serialization, tag=args.tag,
            exclude_frozen_parameters=args.exclude_frozen_parameters)
    except (DsrunError, ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    names = ", ".join(os.path.basename(f) for f in done.files)
    more = f" and {os.path.basename(done.index)}" if done.index else ""
    print(f"wrote {done.tensors} tensors ({done.bytes / 2**20:.1f} MiB) to {args.output_dir}: "
          f"{names}{more}")
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``python -m dsrun.utils.zero_to_fp32`` (module docstring)."""
    parser = arguments("python -m dsrun.utils.zero_to_fp32",
                       "Write a dsrun checkpoint's weights as a plain fp32 state dict "
                       "(DeepSpeed's zero_to_fp32.py).")
    return run(parser.parse_args(argv), torch.float32)


if __name__ == "__main__":
    sys.exit(main())
