"""What the ZeRO stage-3 fetcher (:mod:`~.fetch`) walks: the modules it
hooks (a leaf module - :mod:`dsrun.utils.z3_leaf_module` - as one unit),
their external parameters, and the tensors in their outputs.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch

from dsrun.utils.z3_leaf_module import z3_leaf_module


def external_params(module: torch.nn.Module) -> tuple[torch.Tensor, ...]:
    """The parameters registered with ``module`` by
    :func:`~.init.register_external_parameter` (itself only, not its children)."""
    return tuple(module.__dict__.get("_external_params", {}).values())


def hooked_modules(root: torch.nn.Module) -> Iterator[tuple[str, torch.nn.Module]]:
    """``root.named_modules()`` without what lies inside a leaf module
    (:mod:`dsrun.utils.z3_leaf_module`): a leaf is hooked as one unit."""
    seen: set[int] = set()

    def walk(prefix: str, module: torch.nn.Module) -> Iterator[tuple[str, torch.nn.Module]]:
        if id(module) in seen:
            return
        seen.add(id(module))
        yield prefix, module
        if z3_leaf_module(module):
            return
        for name, child in module.named_children():
            yield from walk(f"{prefix}.{name}" if prefix else name, child)

    yield from walk("", root)


def output_tensors(value: Any) -> Iterator[torch.Tensor]:
    """Every tensor in a module output (tensors, sequences, mappings)."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, Mapping):
        for item in value.values():
            yield from output_tensors(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from output_tensors(item)
