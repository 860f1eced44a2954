"""Which engine trains a parameter: the back-reference ``dsrun.utils`` needs.

DeepSpeed stores back-references on the parameters themselves
(``param._z3_optimizer``, ``param._hp_mapping``) so that
``deepspeed.utils.safe_get_full_fp32_param(param)`` can find the optimizer
holding the parameter's master. dsrun keeps them out of the parameter
objects - an attribute would make ``torch.save(model)`` fail to pickle it -
in one process-wide table keyed by the parameter's identity, whose entries
go away with the parameters, and which holds the engine weakly (a dropped
engine is not kept alive; its parameters then belong to none).

Invariant: after an engine is built, :func:`engine_of` answers it for every
parameter of its module (the last engine built over a parameter wins).
"""

from __future__ import annotations

import weakref
from typing import Any, Optional

import torch
from torch.utils.weak import WeakIdKeyDictionary

_ENGINES: WeakIdKeyDictionary = WeakIdKeyDictionary()


def link_params(engine: Any) -> None:
    """Record ``engine`` as the owner of every parameter of ``engine.module``."""
    ref = weakref.ref(engine)
    for param in engine.module.parameters():
        _ENGINES[param] = ref


def engine_of(param: torch.Tensor) -> Optional[Any]:
    """The engine that trains ``param``, or None (not linked, or the engine is gone)."""
    ref = _ENGINES.get(param)
    return None if ref is None else ref()
