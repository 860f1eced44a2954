"""``deepspeed.comm.utils``: where the launcher put this process, and how
DeepSpeed's communication logger reads a collective's arguments.

The ``*_from_launcher`` queries answer without a process group from what
the launcher set: dsrun's or torchrun's ``RANK``/``WORLD_SIZE``/
``LOCAL_RANK``, else MPI's (Open MPI, MPICH/PMI) or Slurm's variables (the
order of :meth:`dsrun.runtime.env.DistEnv.detect`), else a single process.
DeepSpeed's read ``RANK`` then Open MPI's only; the answers agree where
both have one.

The argument helpers take a function (a collective) and its call's
arguments, with DeepSpeed's results: :func:`get_default_args`,
:func:`get_tensor_position` (the index of the tensor parameter, ``-1``
without one), :func:`get_tensor_kwarg`, :func:`get_msg_size_from_args`
(the bytes the logger files a call under) and :func:`get_debug_log_name`.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import Any

from dsrun.runtime.dist import _mpi_world_size
from dsrun.utils.comms_logging import get_caller_func

__all__ = ["get_debug_log_name", "get_default_args", "get_local_rank_from_launcher",
           "get_msg_size_from_args", "get_tensor_kwarg", "get_tensor_position",
           "get_world_rank_from_launcher", "get_world_size_from_launcher"]

# the names torch's collectives (and DeepSpeed's) give their tensor input, in
# DeepSpeed's order of preference
_TENSOR_PARAMETERS = ("tensor", "tensors", "input_list", "input_tensor_list", "p2p_op_list")


def _launcher_env() -> Any:
    from dsrun.runtime.env import DistEnv

    return DistEnv.detect(mpi_size=_mpi_world_size)


def get_world_rank_from_launcher() -> int:
    """This process's global rank as the launcher set it (module docstring;
    0 for a single process), with or without a process group."""
    return int(_launcher_env().rank)


def get_world_size_from_launcher() -> int:
    """The job's world size as the launcher set it (1 for a single process)."""
    return int(_launcher_env().world_size)


def get_local_rank_from_launcher() -> int:
    """This process's rank on its host as the launcher set it (0 alone)."""
    return int(_launcher_env().local_rank)


def get_default_args(func: Callable[..., Any]) -> dict[str, Any]:
    """``func``'s parameters that have a default, with it."""
    return {name: p.default for name, p in inspect.signature(func).parameters.items()
            if p.default is not inspect.Parameter.empty}


def get_tensor_position(func: Callable[..., Any]) -> int:
    """The position of ``func``'s tensor parameter (``tensor``, ``tensors``,
    ``input_list``, ``input_tensor_list`` or ``p2p_op_list``, the first of
    those it has), ``-1`` when it has none (a barrier)."""
    names = list(inspect.signature(func).parameters)
    for name in _TENSOR_PARAMETERS:
        if name in names:
            return names.index(name)
    return -1


def get_tensor_kwarg(func: Callable[..., Any], kwargs: Mapping[str, Any]) -> Any:
    """The tensor argument of a call of ``func`` from its keyword arguments
    (or that parameter's default), ``None`` when there is none."""
    given = {**get_default_args(func), **kwargs}
    for name in _TENSOR_PARAMETERS:
        if name in given:
            return given[name]
    return None


def get_msg_size_from_args(func: Callable[..., Any], *args: Any, **kwargs: Any) -> int:
    """The message size, in bytes, DeepSpeed's logger files a call
    ``func(*args, **kwargs)`` under: its tensor argument's, the sum over a
    list (``P2POp`` entries count their tensor), 0 without one."""
    tensor = None
    if args:
        position = get_tensor_position(func)
        if -1 < position < len(args):
            tensor = args[position]
    if tensor is None and kwargs:
        tensor = get_tensor_kwarg(func, kwargs)
    if tensor is None:
        return 0
    if isinstance(tensor, list):
        parts = [getattr(item, "tensor", item) for item in tensor]
        return sum(t.element_size() * t.nelement() for t in parts)
    return int(tensor.element_size() * tensor.nelement())


def get_debug_log_name(func_args: Mapping[str, Any], debug: Any) -> str:
    """``func_args["log_name"]``, with the name of the function that called
    this one's caller when ``debug`` is true (as DeepSpeed's)."""
    if debug:
        return f"{func_args['log_name']} | [Caller Func: {get_caller_func()}]"
    return str(func_args["log_name"])
