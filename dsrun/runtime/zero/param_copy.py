"""``copy.deepcopy`` of a ZeRO-3 partitioned parameter (``ZeroParameter.__deepcopy__``).

A copy is a partitioned parameter of its own: each rank copies its shard
(``ds_tensor``) and the data it holds now, and the copy gets a fresh
``ds_id`` (equal on every rank that copies the same parameters in the same
order, as ``zero.Init`` numbers them) and no pins, so ZeRO manages it as any
parameter built under ``zero.Init``. This is what a parent built under
``zero.Init`` needs when it clones a child already partitioned - the
``copy.deepcopy(layer)`` of ``nn.TransformerEncoder``/``TransformerDecoder``,
the "annotated transformer"'s ``clones()`` - and what ``copy.deepcopy(model)``
inside the ``with zero.Init():`` block gives: a second partitioned model
with the same values, to pass to ``initialize()``.

A *released* parameter is copied this way only while a ``zero.Init``
context is open (:func:`~.released.building`). Outside one, its copy
could only be used as a standalone model - an EMA copy, ``AveragedModel``,
``copy.deepcopy(engine.module)`` - whose forward would run on parameters
holding no values: that is refused
(:class:`~.released.ReleasedParameterError`, naming the ways out). Inside a
``GatheredParameters`` the parameter is whole and the copy holds the full
values (its shard is refreshed from them), outside ``zero.Init`` too.
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from dsrun.errors import DsrunError
from dsrun.runtime.zero import partitioned as parts
from dsrun.runtime.zero.released import building, released, released_error

__all__ = ["deepcopy_param"]


def deepcopy_param(param: torch.Tensor, memo: dict[int, Any]) -> torch.Tensor:
    """The copy of ``param`` (a ``ZeroParameter``) for ``copy.deepcopy``
    (module docstring)."""
    if id(param) in memo:
        return memo[id(param)]
    cls = type(param)
    if "ds_id" not in param.__dict__:  # nn.Parameter(p) of a partitioned p: not managed
        plain = cls(param.data.clone(), param.requires_grad)
        memo[id(param)] = plain
        plain.__dict__.update(copy.deepcopy(param.__dict__, memo))
        return plain
    if param.__dict__.get("ds_status") is parts.ZeroParamStatus.INFLIGHT:
        raise DsrunError(f"cannot copy {parts.param_name(param)} while its gather is in flight")
    if released(param) and not building():  # a standalone copy would hold no values
        raise released_error(param, "cannot copy.deepcopy", "deepcopy")
    result = cls(param.data.clone(), param.requires_grad)
    memo[id(param)] = result
    for key, value in param.__dict__.items():
        if key == "ds_group":
            result.__dict__[key] = value  # a process group is shared, not copied
        elif not key.startswith("_ds_"):  # a pending gather, kept data: the original's
            result.__dict__[key] = copy.deepcopy(value, memo)
    result.__dict__.update(ds_id=next(parts._ids), ds_pins=0, _ds_pending=None)
    if param.data.numel() and parts.shard_is_view(param):
        result.ds_tensor = result.data.view(-1)
    elif result.data.numel():  # whole now (a gather): the shard is what the copy holds
        parts.refresh_shard(result)
    return result
