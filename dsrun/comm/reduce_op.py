"""``deepspeed.comm.reduce_op``: DeepSpeed's ``ReduceOp`` enumeration.

DeepSpeed's collectives take their own ``ReduceOp`` (an :class:`enum.Enum`,
also ``deepspeed.comm.ReduceOp``) and translate it to torch's before they
call ``torch.distributed``; they take torch's ``ReduceOp`` unchanged too.
:func:`to_torch` is that translation for every reduction of
:mod:`dsrun.comm`.
"""

from __future__ import annotations

from enum import Enum
from typing import Any

import torch.distributed as dist

__all__ = ["ReduceOp"]


class ReduceOp(Enum):
    """DeepSpeed's reduction operations (values as in DeepSpeed 0.19.8)."""

    SUM = 0
    PRODUCT = 1
    MIN = 2
    MAX = 3
    BAND = 4
    BOR = 5
    BXOR = 6
    AVG = 7
    UNUSED = 8


def to_torch(op: Any) -> Any:
    """torch's operation for ``op``: a :class:`ReduceOp` member becomes
    ``torch.distributed.ReduceOp``'s of the same name; anything else (torch's
    own, a premultiplied sum) goes to torch as it is, for torch to judge."""
    if not isinstance(op, ReduceOp):
        return op
    if op is ReduceOp.UNUSED:
        raise ValueError("deepspeed.comm.ReduceOp.UNUSED is not a reduction: pass SUM, "
                         "PRODUCT, MIN, MAX, BAND, BOR, BXOR or AVG")
    return getattr(dist.ReduceOp, op.name)
