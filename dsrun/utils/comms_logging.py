"""DeepSpeed's ``deepspeed.utils.comms_logging`` module path.

:class:`CommsLogger` is dsrun's communication logger class
(:mod:`dsrun.runtime.commlog`; the process's instance is
``deepspeed.comm.comms_logger``). The helpers give dsrun's numbers under
DeepSpeed's signatures: :func:`calc_bw_log` takes a message size as the
logger files it and a duration in milliseconds, and returns (algbw, busbw)
in Gbit/s by nccl-tests' definitions (see :mod:`dsrun.runtime.commlog`:
all-gathers count the gathered result, an all-reduce's algbw is not
doubled); :func:`convert_size` formats sizes as DeepSpeed does.
"""

from __future__ import annotations

import sys

from dsrun.runtime.commlog import (
    ALL_REDUCE_OPS,
    SCATTER_GATHER_OPS,
    CommsLogger,
    bandwidths,
    size_str,
)

__all__ = ["CommsLogger", "calc_bw_log", "convert_size", "get_caller_func", "print_rank_0"]

# The operations DeepSpeed's calc_bw_log knows besides the collectives above.
_OTHER_OPS = frozenset({"send", "recv", "isend", "irecv", "batch_isend_irecv", "broadcast",
                        "broadcast_object_list", "reduce", "gather", "scatter", "barrier"})


def get_caller_func(frame: int = 3) -> str:
    """The name of the function ``frame`` frames up the stack from here."""
    return sys._getframe(frame).f_code.co_name


def print_rank_0(message: object) -> None:
    """Print ``message`` on global rank 0 (or without a process group)."""
    from dsrun import comm

    if comm.get_rank() == 0:
        print(message)


def convert_size(size_bytes: int) -> str:
    """``size_bytes`` in the largest power-of-1024 unit, rounded to 2
    decimals: ``"0B"``, ``"1.0 KB"``, ``"1.5 MB"`` (DeepSpeed's format, the
    logger's ``msg_size_str``)."""
    return size_str(size_bytes)


def calc_bw_log(comm_op: str, size: int, duration: float) -> tuple[float, float]:
    """(algbw, busbw) in Gbit/s of one ``comm_op`` filed under message size
    ``size`` that took ``duration`` milliseconds, on the world group."""
    if comm_op not in ALL_REDUCE_OPS | SCATTER_GATHER_OPS | _OTHER_OPS:
        raise ValueError(f"calc_bw_log: unknown communication operation {comm_op!r}")
    from dsrun import comm

    return bandwidths(comm_op, size, comm.get_world_size(), duration / 1e3)
