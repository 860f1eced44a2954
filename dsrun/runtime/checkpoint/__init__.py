"""Checkpoints that load anywhere: any world size, any ZeRO stage, crash-safe.

* :mod:`.fragments` - the interface between state holders (ZeRO optimizers,
  the stage-0 path, module tensors) and the format: per-name fragments.
* :mod:`.manifest`, :mod:`.records`, :mod:`.tags` - the on-disk format
  (pure): manifest, per-rank records, tags and ``latest``.
* :mod:`.writer` (:func:`save_state`), :mod:`.async_save`, :mod:`.reader`
  (:func:`load_state`) - saving and resharding loads, with
  :mod:`.coord` (agreement among ranks, with a deadline) and
  :mod:`.storage` (durable, checked file I/O).
* :mod:`.engine_io`, :mod:`.rank_state`, :mod:`.model16` - the engine's
  ``save_checkpoint``/``load_checkpoint``/``save_16bit_model``.
* :mod:`.consolidate` (:func:`to_fp32`, :func:`write_shards`,
  :func:`get_fp32_state_dict`; shard planning in :mod:`.shards`) and
  :mod:`.info` - offline tools behind ``dsrun checkpoint to-fp32|info`` and
  ``dsrun.utils.zero_to_fp32``; :mod:`.from_deepspeed`
  (:func:`import_deepspeed_checkpoint`, ``dsrun checkpoint from-deepspeed``).

Names are loaded lazily so that ``import dsrun.runtime.checkpoint.info``
(the launcher's ``dsrun checkpoint info``) needs no torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "save_state": "dsrun.runtime.checkpoint.writer",
    "SaveRequest": "dsrun.runtime.checkpoint.writer",
    "load_state": "dsrun.runtime.checkpoint.reader",
    "LoadRequest": "dsrun.runtime.checkpoint.reader",
    "Coordinator": "dsrun.runtime.checkpoint.coord",
    "to_fp32": "dsrun.runtime.checkpoint.consolidate",
    "write_shards": "dsrun.runtime.checkpoint.consolidate",
    "get_fp32_state_dict": "dsrun.runtime.checkpoint.consolidate",
    "checkpoint_info": "dsrun.runtime.checkpoint.info",
    "import_deepspeed_checkpoint": "dsrun.runtime.checkpoint.from_deepspeed",
}

__all__ = list(_LAZY)


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'dsrun.runtime.checkpoint' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
