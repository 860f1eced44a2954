"""``deepspeed.comm.pg_utils``: optional parallel groups.

Code for an optional parallel dimension (tensor, sequence, expert...)
receives ``group=None`` where that dimension is not used: here ``None``
means *no parallelism*, where ``deepspeed.comm``'s collectives read it as
the world group. So, as in DeepSpeed, this module is not re-exported from
``deepspeed.comm``: ``from deepspeed.comm import pg_utils``.
"""

from __future__ import annotations

from typing import Any

__all__ = ["is_parallel"]


def is_parallel(group: Any) -> bool:
    """Whether ``group`` spans more than one rank (a collective over it does
    something); ``None`` is no group and answers False without a process
    group."""
    if group is None:
        return False
    from dsrun.comm.comm import get_world_size

    return get_world_size(group) > 1
