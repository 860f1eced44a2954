"""Which ZeRO optimizer owns a parameter's storage now.

A ZeRO optimizer (stages 1-3) makes its parameters views of its own flat
buffers (:mod:`~.flat`, the stage-3 partitioning), and its masters alias
or copy those buffers. ``initialize()`` called again on the same model
builds a second optimizer that moves the same parameters into *its*
buffers: the first one's step would then update memory the module no
longer uses - silently, its engine looking as if it trained.

:func:`claim` is called by each ZeRO optimizer before it re-lays out its
parameters' storage (a stage-3 engine claims every parameter of its module,
also without an optimizer: it re-partitions them all, and its hooks would
drop the older engine's gradients). A live optimizer that laid any of them
out before is superseded (:meth:`Owner.supersede`): its gradient hooks come
off (two bucket reducers on one parameter would fight over its gradient),
and its next gradient reduction or step raises (:meth:`Owner.check_owner`)
- one attribute read per step, no work per parameter.
``engine.destroy()`` on the older engine first, then ``initialize()``
again, is the supported way to start over (the destroyed one is marked
too, and is not stepped again).

The registry is keyed by ``id(param)`` with weak references to the
parameter and its owner, so it keeps neither alive and adds no attribute to
the parameters (which would have to survive ``torch.save`` of the module).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import Any, Callable

import torch

from dsrun.errors import DsrunError

#: id(param) -> (weak ref to the parameter, weak ref to its ZeRO optimizer)
_owners: dict[int, tuple[weakref.ref[torch.Tensor], weakref.ref[Any]]] = {}

SUPERSEDED = ("these parameters now belong to a newer engine: initialize() was called "
              "again on this model; use the newer engine, or destroy() the older one first")


class Owner:
    """Mixin for ZeRO optimizers: :meth:`claim_params` at construction,
    :meth:`check_owner` before each gradient reduction and step."""

    #: a later ZeRO optimizer re-laid out some of these parameters
    superseded: bool = False
    stage: int

    def claim_params(self, params: Iterable[torch.Tensor]) -> None:
        claim(self, params)

    def supersede(self) -> None:
        """A newer engine took (some of) these parameters: remove this
        optimizer's hooks (its ``close()``, which ``destroy()`` calls; again
        is harmless) and refuse its next step."""
        self.superseded = True
        self.close()

    def close(self) -> None:  # pragma: no cover - every ZeRO optimizer defines it
        raise NotImplementedError

    def check_owner(self) -> None:
        """Raise if a newer engine took these parameters (module docstring)."""
        if self.superseded:
            raise DsrunError(f"ZeRO stage {self.stage} engine: {SUPERSEDED}")


def _forget(key: int) -> Callable[[weakref.ref[torch.Tensor]], None]:
    def drop(ref: weakref.ref[torch.Tensor]) -> None:
        entry = _owners.get(key)
        if entry is not None and entry[0] is ref:  # not a newer tensor with the same id
            del _owners[key]
    return drop


def claim(owner: Owner, params: Iterable[torch.Tensor]) -> None:
    """``owner`` lays out ``params`` now: every other live owner of any of
    them is superseded (once per parameter, at construction only)."""
    for param in params:
        key = id(param)
        entry = _owners.get(key)
        if entry is not None and entry[0]() is param:
            previous = entry[1]()
            if previous is not None and previous is not owner and not previous.superseded:
                previous.supersede()
        _owners[key] = (weakref.ref(param, _forget(key)), weakref.ref(owner))

