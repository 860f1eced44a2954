"""The in-rank runtime: environment detection, bootstrap, config and engine.

Submodules load on first attribute access (PEP 562), so that
``import deepspeed`` (dsrun) followed by ``deepspeed.runtime.utils.X``,
``deepspeed.runtime.zero.Init`` or ``deepspeed.runtime.lr_schedules.X``
works as in DeepSpeed, whose ``__init__`` imports them eagerly, while the
launcher and node agents, which import this package, stay torch-free.
"""

from __future__ import annotations

import importlib
import importlib.util
from types import ModuleType


def __getattr__(name: str) -> ModuleType:
    # dunders and private names are never submodules: answer them at once
    # (copy, pickle and inspect probe for such names)
    if name.startswith("_") or not name.isidentifier() \
            or importlib.util.find_spec(f"{__name__}.{name}") is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return importlib.import_module(f"{__name__}.{name}")

