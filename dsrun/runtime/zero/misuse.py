"""Name the parameter behind torch's error for a released ZeRO-3 parameter.

A partitioned parameter holds an empty tensor outside its module's forward.
Code that uses it there - an L2 term added to the loss in the training
loop, say - runs its forward on the empty tensor and fails in backward with
torch's "Function PowBackward0 returned an invalid gradient at index 0 -
got [0] but expected shape compatible with [16, 16]", which names neither
the parameter nor the cause. :func:`released_use_error` turns that message
into one that lists the partitioned parameters of that shape and says what
to do instead.
"""

from __future__ import annotations

import re
from typing import Optional

import torch

from dsrun.errors import DsrunError

_EMPTY_GRADIENT = re.compile(
    r"returned an invalid gradient at index \d+ - got \[0\] but expected shape "
    r"compatible with \[([0-9, ]*)\]")


def released_use_error(module: torch.nn.Module, err: BaseException) -> Optional[DsrunError]:
    """A :class:`DsrunError` explaining ``err`` when it is torch's error for an
    empty (released) ZeRO-3 parameter in ``module``; None otherwise."""
    found = _EMPTY_GRADIENT.search(str(err))
    if found is None:
        return None
    shape = tuple(int(d) for d in found.group(1).replace(" ", "").split(",") if d)
    names = [name for name, p in module.named_parameters()
             if tuple(getattr(p, "ds_shape", ())) == shape and p.data.numel() == 0]
    if not names:
        return None
    listed = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
    return DsrunError(
        f"engine.backward(): a ZeRO-3 parameter of shape {list(shape)} was used outside "
        f"its module's forward, while it was partitioned (empty on this rank); "
        f"partitioned parameters of that shape: {listed}. Use it inside a module's "
        "forward (a parameter of another module: "
        "deepspeed.zero.register_external_parameter(module, param)), or read its full "
        "value without a gradient under deepspeed.zero.GatheredParameters([param]) "
        f"(torch: {found.group(0)})")
