"""``deepspeed.comm.comm``: DeepSpeed's communication API, which
``deepspeed.comm`` re-exports (``from deepspeed import comm as dist``).

The collectives take ``torch.distributed``'s arguments plus DeepSpeed's
``prof``, ``log_name`` and ``debug`` keywords, and return what torch
returns (a work handle with ``async_op=True``). Reductions take DeepSpeed's
:class:`~dsrun.comm.reduce_op.ReduceOp` (``deepspeed.comm.ReduceOp``) or
torch's.

dsrun's engine, ZeRO stages and pipelines communicate through these same
functions, so DeepSpeed's communication logger sees all of it: enable it
with ``"comms_logger": {"enabled": true}`` in the config (the engine calls
:func:`configure`) or :func:`configure` ``(enabled=True)``, train, then
:func:`log_summary` prints per operation and message size the count,
latencies and bandwidths (:mod:`dsrun.runtime.commlog` says how they are
measured: profiled operations run blocking; :mod:`dsrun.comm.profiled`
runs them). Not logged: the coalesced all-gathers of stage 3 on NCCL (one
launch for many parameters) and torch's own collectives inside DDP or
FSDP.

Rank queries: :func:`get_local_rank` is the rank on this host, from
dsrun's (or torchrun's ``LOCAL_RANK``, MPI's, Slurm's) environment;
:mod:`dsrun.comm.utils` has the ``*_from_launcher`` ones.
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Callable, Sequence
from typing import Any, Optional

import torch
import torch.distributed as dist

from dsrun import TORCH_DISTRIBUTED_DEFAULT_PORT
from dsrun.comm import constants, log, utils
from dsrun.comm.constants import *  # noqa: F403 - DeepSpeed's deepspeed.comm has them
from dsrun.comm.init_dist import init_distributed
from dsrun.comm.log import *  # noqa: F403 - the logger's API, where DeepSpeed has it
from dsrun.comm.profiled import Done, call, list_bytes, nbytes, wait
from dsrun.comm.reduce_op import ReduceOp, to_torch
from dsrun.comm.utils import *  # noqa: F403 - as DeepSpeed's comm.py
from dsrun.constants import default_pg_timeout  # DeepSpeed's comm.py has it

__all__ = [
    "P2POp", "ProcessGroup", "ReduceOp", "TORCH_DISTRIBUTED_DEFAULT_PORT", "all_gather",
    "all_gather_coalesced", "all_gather_into_tensor", "all_gather_object", "all_reduce",
    "all_reduce_coalesced", "all_to_all", "all_to_all_single", "allgather_fn", "barrier",
    "batch_isend_irecv", "broadcast", "broadcast_object_list", "default_pg_timeout",
    "destroy_process_group",
    "gather", "get_all_ranks_from_group", "get_global_rank", "get_local_rank", "get_rank",
    "get_world_group", "get_world_size", "has_all_gather_into_tensor",
    "has_all_reduce_coalesced", "has_coalescing_manager", "has_reduce_scatter_tensor",
    "in_aml", "in_aws_sm", "in_dlts", "inference_all_reduce", "init_distributed",
    "initialize_mesh_device", "irecv", "is_available", "is_initialized", "isend",
    "monitored_barrier", "new_group", "recv", "reduce", "reduce_scatter",
    "reduce_scatter_fn", "reduce_scatter_tensor", "scatter", "send",
    *constants.__all__, *log.__all__, *utils.__all__,
]

# torch 2.13's non-deprecated names of the tensor-form collectives
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = (getattr(dist, "reduce_scatter_single", None)
                          or dist.reduce_scatter_tensor)


# ------------------------------------------------------------ collectives


def all_reduce(tensor: torch.Tensor, op: Any = ReduceOp.SUM, group: Any = None,
               async_op: bool = False, prof: bool = False, log_name: str = "all_reduce",
               debug: Any = None) -> Any:
    return call("all_reduce", log_name, prof, group, lambda: nbytes(tensor), tensor,
                dist.all_reduce, tensor, op=to_torch(op), group=group, async_op=async_op)


def inference_all_reduce(tensor: torch.Tensor, op: Any = ReduceOp.SUM, group: Any = None,
                         async_op: bool = False, prof: bool = False,
                         log_name: str = "all_reduce", debug: Any = None) -> torch.Tensor:
    """DeepSpeed's low-latency all-reduce for inference: a plain all-reduce
    here (none on one rank), blocking whatever ``async_op`` says (as
    DeepSpeed's); returns ``tensor``, reduced in place, as DeepSpeed's does
    on one rank and with its CPU kernel. Logged under ``all_reduce``, as
    DeepSpeed files it (``prof_ops: ["all_reduce"]`` counts it)."""
    def run() -> torch.Tensor:
        if dist.get_world_size(group) > 1:
            dist.all_reduce(tensor, op=to_torch(op), group=group)
        return tensor
    return call("inference_all_reduce", log_name, prof, group, lambda: nbytes(tensor),
                tensor, run)


def all_reduce_coalesced(tensors: Sequence[torch.Tensor], op: Any = ReduceOp.SUM,
                         group: Any = None, async_op: bool = False, prof: bool = False,
                         log_name: str = "all_reduce", debug: Any = None) -> Any:
    """All-reduce every tensor of ``tensors`` (one flat buffer, copied back;
    completed within the call, also with ``async_op``). Logged under
    ``all_reduce``, as DeepSpeed files it."""
    tensors = list(tensors)

    def run() -> Any:
        flat = torch.cat([t.reshape(-1) for t in tensors])
        dist.all_reduce(flat, op=to_torch(op), group=group)
        offset = 0
        for t in tensors:
            t.copy_(flat[offset:offset + t.numel()].view_as(t))
            offset += t.numel()
        return Done() if async_op else None
    return call("all_reduce_coalesced", log_name, prof, group,
                lambda: list_bytes(tensors), tensors[0] if tensors else None, run)


def broadcast(tensor: torch.Tensor, src: int, group: Any = None, async_op: bool = False,
              prof: bool = False, log_name: str = "broadcast", debug: Any = None) -> Any:
    return call("broadcast", log_name, prof, group, lambda: nbytes(tensor), tensor,
                dist.broadcast, tensor, src=src, group=group, async_op=async_op)


def reduce(tensor: torch.Tensor, dst: int, op: Any = ReduceOp.SUM, group: Any = None,
           async_op: bool = False, prof: bool = False, log_name: str = "reduce",
           debug: Any = None) -> Any:
    return call("reduce", log_name, prof, group, lambda: nbytes(tensor), tensor,
                dist.reduce, tensor, dst=dst, op=to_torch(op), group=group, async_op=async_op)


def all_gather(tensor_list: list[torch.Tensor], tensor: torch.Tensor, group: Any = None,
               async_op: bool = False, prof: bool = False, log_name: str = "all_gather",
               debug: Any = None) -> Any:
    return call("all_gather", log_name, prof, group, lambda: nbytes(tensor), tensor,
                dist.all_gather, tensor_list, tensor, group=group, async_op=async_op)


def all_gather_into_tensor(output_tensor: torch.Tensor, tensor: torch.Tensor,
                           group: Any = None, async_op: bool = False, prof: bool = False,
                           log_name: str = "all_gather_into_tensor", debug: Any = None) -> Any:
    return call("all_gather_into_tensor", log_name, prof, group,
                lambda: nbytes(tensor), tensor, _all_gather_single, output_tensor,
                tensor, group=group, async_op=async_op)


def allgather_fn(output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any = None,
                 async_op: bool = False, debug: Any = None) -> Any:
    """DeepSpeed's name for :func:`all_gather_into_tensor`; logged under that
    name, as DeepSpeed's (so ``prof_ops: ["all_gather_into_tensor"]`` counts it)."""
    return all_gather_into_tensor(output_tensor, input_tensor, group=group, async_op=async_op)


def all_gather_coalesced(output_tensors: Sequence[torch.Tensor],
                         input_tensors: Sequence[torch.Tensor], group: Any = None,
                         async_op: bool = False, prof: bool = False,
                         log_name: str = "all_gather_coalesced", debug: Any = None) -> Any:
    """``all_gather_into_tensor`` of each pair, issued together; with
    ``async_op`` a list of work handles."""
    pairs = list(zip(output_tensors, input_tensors))

    def run() -> Any:
        works = [_all_gather_single(out, inp, group=group, async_op=True) for out, inp in pairs]
        if async_op:
            return works
        wait(works)
        return None
    return call("all_gather_coalesced", log_name, prof, group,
                lambda: list_bytes([inp for _, inp in pairs]),
                pairs[0][1] if pairs else None, run)


def reduce_scatter_tensor(output_tensor: torch.Tensor, tensor: torch.Tensor,
                          op: Any = ReduceOp.SUM, group: Any = None, async_op: bool = False,
                          prof: bool = False, log_name: str = "reduce_scatter_tensor",
                          debug: Any = None) -> Any:
    return call("reduce_scatter_tensor", log_name, prof, group, lambda: nbytes(tensor),
                tensor, _reduce_scatter_single, output_tensor, tensor, op=to_torch(op),
                group=group, async_op=async_op)


def reduce_scatter_fn(output_tensor: torch.Tensor, tensor: torch.Tensor,
                      op: Any = ReduceOp.SUM, group: Any = None, async_op: bool = False,
                      prof: bool = False, debug: Any = None) -> Any:
    """DeepSpeed's name for :func:`reduce_scatter_tensor`; logged under that
    name, as DeepSpeed's."""
    return reduce_scatter_tensor(output_tensor, tensor, op=op, group=group, async_op=async_op,
                                 prof=prof)


def reduce_scatter(output: torch.Tensor, input_list: list[torch.Tensor],
                   op: Any = ReduceOp.SUM, group: Any = None, async_op: bool = False,
                   prof: bool = False, log_name: str = "reduce_scatter",
                   debug: Any = None) -> Any:
    return call("reduce_scatter", log_name, prof, group, lambda: list_bytes(input_list),
                output, dist.reduce_scatter, output, input_list, op=to_torch(op), group=group,
                async_op=async_op)


def all_to_all_single(output: torch.Tensor, tensor: torch.Tensor,
                      output_split_sizes: Optional[list[int]] = None,
                      input_split_sizes: Optional[list[int]] = None, group: Any = None,
                      async_op: bool = False, prof: bool = False,
                      log_name: str = "all_to_all_single", debug: Any = None) -> Any:
    return call("all_to_all_single", log_name, prof, group, lambda: nbytes(tensor), tensor,
                dist.all_to_all_single, output, tensor, output_split_sizes=output_split_sizes,
                input_split_sizes=input_split_sizes, group=group, async_op=async_op)


def all_to_all(output_tensor_list: list[torch.Tensor], input_tensor_list: list[torch.Tensor],
               group: Any = None, async_op: bool = False, prof: bool = False,
               log_name: str = "all_to_all", debug: Any = None) -> Any:
    return call("all_to_all", log_name, prof, group, lambda: list_bytes(input_tensor_list),
                input_tensor_list[0] if input_tensor_list else None, dist.all_to_all,
                output_tensor_list, input_tensor_list, group=group, async_op=async_op)


def gather(tensor: torch.Tensor, gather_list: Optional[list[torch.Tensor]] = None, dst: int = 0,
           group: Any = None, async_op: bool = False, prof: bool = False,
           log_name: str = "gather", debug: Any = None) -> Any:
    return call("gather", log_name, prof, group, lambda: nbytes(tensor), tensor, dist.gather,
                tensor, gather_list=gather_list, dst=dst, group=group, async_op=async_op)


def scatter(tensor: torch.Tensor, scatter_list: Optional[list[torch.Tensor]] = None,
            src: int = 0, group: Any = None, async_op: bool = False, prof: bool = False,
            log_name: str = "scatter", debug: Any = None) -> Any:
    return call("scatter", log_name, prof, group, lambda: nbytes(tensor), tensor,
                dist.scatter, tensor, scatter_list=scatter_list, src=src, group=group,
                async_op=async_op)


def all_gather_object(object_list: list[Any], obj: Any, group: Any = None, prof: bool = False,
                      log_name: str = "all_gather_object", debug: Any = None) -> Any:
    return call("all_gather_object", log_name, prof, group, lambda: 0, None,
                dist.all_gather_object, object_list, obj, group=group)


def broadcast_object_list(object_list: list[Any], src: int, group: Any = None,
                          device: Any = None, prof: bool = False,
                          log_name: str = "broadcast_object_list", debug: Any = None) -> Any:
    return call("broadcast_object_list", log_name, prof, group, lambda: 0, None,
                dist.broadcast_object_list, object_list, src=src, group=group, device=device)


def barrier(group: Any = None, async_op: bool = False, device_ids: Optional[list[int]] = None,
            prof: bool = False, log_name: str = "barrier", debug: Any = None) -> Any:
    return call("barrier", log_name, prof, group, lambda: 0, None, dist.barrier, group=group,
                async_op=async_op, device_ids=device_ids)


def monitored_barrier(group: Any = None, timeout: Optional[datetime.timedelta] = None,
                      wait_all_ranks: bool = False, prof: bool = False,
                      log_name: str = "monitored_barrier", debug: Any = None) -> Any:
    return call("monitored_barrier", log_name, prof, group, lambda: 0, None,
                dist.monitored_barrier, group=group, timeout=timeout,
                wait_all_ranks=wait_all_ranks)


# ------------------------------------------------------------ point to point


def send(tensor: torch.Tensor, dst: int, group: Any = None, tag: int = 0, prof: bool = False,
         log_name: str = "send", debug: Any = None) -> Any:
    return call("send", log_name, prof, group, lambda: nbytes(tensor), tensor, dist.send,
                tensor, dst=dst, group=group, tag=tag)


def recv(tensor: torch.Tensor, src: Optional[int] = None, group: Any = None, tag: int = 0,
         prof: bool = False, log_name: str = "recv", debug: Any = None) -> Any:
    return call("recv", log_name, prof, group, lambda: nbytes(tensor), tensor, dist.recv,
                tensor, src=src, group=group, tag=tag)


def isend(tensor: torch.Tensor, dst: int, group: Any = None, tag: int = 0, prof: bool = False,
          log_name: str = "isend", debug: Any = None) -> Any:
    return call("isend", log_name, prof, group, lambda: nbytes(tensor), tensor, dist.isend,
                tensor, dst=dst, group=group, tag=tag, point_to_point=True)


def irecv(tensor: torch.Tensor, src: Optional[int] = None, group: Any = None, tag: int = 0,
          prof: bool = False, log_name: str = "irecv", debug: Any = None) -> Any:
    return call("irecv", log_name, prof, group, lambda: nbytes(tensor), tensor, dist.irecv,
                tensor, src=src, group=group, tag=tag, point_to_point=True)


class P2POp:
    """One operation of :func:`batch_isend_irecv` (DeepSpeed's
    ``deepspeed.comm.P2POp``): ``op`` is :func:`isend` or :func:`irecv` -
    this module's or ``torch.distributed``'s."""

    def __init__(self, op: Callable[..., Any], tensor: torch.Tensor, peer: Optional[int] = None,
                 group: Any = None, tag: int = 0, group_peer: Optional[int] = None) -> None:
        if op in (isend, dist.isend):
            self.op: Callable[..., Any] = dist.isend
        elif op in (irecv, dist.irecv):
            self.op = dist.irecv
        else:
            raise ValueError(f"P2POp: op must be isend or irecv (deepspeed.comm's or "
                             f"torch.distributed's), got {op!r}")
        self.tensor, self.peer, self.group, self.tag = tensor, peer, group, tag
        self.group_peer = group_peer

    def torch_op(self) -> dist.P2POp:
        if self.group_peer is not None:
            return dist.P2POp(self.op, self.tensor, group=self.group, tag=self.tag,
                              group_peer=self.group_peer)
        return dist.P2POp(self.op, self.tensor, self.peer, self.group, self.tag)


def batch_isend_irecv(p2p_op_list: list[Any], prof: bool = False,
                      log_name: str = "batch_isend_irecv", debug: Any = None) -> Any:
    ops = list(p2p_op_list)
    return call("batch_isend_irecv", log_name, prof, ops[0].group if ops else None,
                lambda: sum(nbytes(o.tensor) for o in ops), ops[0].tensor if ops else None,
                dist.batch_isend_irecv, [op.torch_op() if isinstance(op, P2POp) else op
                                         for op in ops], point_to_point=True)


# ------------------------------------------------------------ groups, ranks


def is_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def is_available() -> bool:
    return dist.is_available()


def get_rank(group: Any = None) -> int:
    """This process's rank in ``group``; 0 before a process group exists
    (world size 1 scripts), as DeepSpeed reads it."""
    if not is_initialized():
        return int(os.environ.get("RANK", 0))
    return dist.get_rank(group)


def get_world_size(group: Any = None) -> int:
    if not is_initialized():
        return int(os.environ.get("WORLD_SIZE", 1))
    return dist.get_world_size(group)


def get_local_rank() -> int:
    """The rank of this process on its host (module docstring)."""
    value = os.environ.get("LOCAL_RANK")
    if value is not None:
        return int(value)
    from dsrun.runtime.env import DistEnv

    return DistEnv.detect().local_rank


def get_global_rank(group: Any = None, group_rank: int = 0) -> int:
    return dist.get_global_rank(group, group_rank) if group is not None else group_rank


def get_all_ranks_from_group(group: Any = None) -> list[int]:
    """The global ranks of ``group``'s members, in group-rank order, on
    every rank: also on one outside the group, as DeepSpeed's (where
    ``new_group`` gave torch's non-member sentinel, torch's record of it:
    the last group made without this rank). ``None``: the world (DeepSpeed
    answers ``[]``)."""
    if group is None:
        return list(range(get_world_size()))
    return list(dist.get_process_group_ranks(group))


def get_world_group() -> Any:
    return dist.group.WORLD


def new_group(ranks: Sequence[int]) -> Any:
    return dist.new_group(list(ranks))


def destroy_process_group(group: Any = None) -> None:
    dist.destroy_process_group(group)


def has_all_gather_into_tensor() -> bool:
    return True


def has_reduce_scatter_tensor() -> bool:
    return True


def has_all_reduce_coalesced() -> bool:
    return True


def has_coalescing_manager() -> bool:
    return hasattr(dist, "_coalescing_manager")



class ProcessGroup:
    """DeepSpeed's record of a group: ``comm_id``, its ``ranks`` and ``size``
    (dsrun's groups are torch's; nothing here makes one)."""

    def __init__(self, comm_id: Any, ranks: Optional[Sequence[int]] = None) -> None:
        self.ranks = list(ranks or [])
        self.comm_id = comm_id
        self.size = len(self.ranks)


def initialize_mesh_device(mesh_shape: Sequence[int],
                           mesh_dim_names: Optional[Sequence[str]]) -> Any:
    """torch's ``DeviceMesh`` of ``mesh_shape`` over the world group, on the
    accelerator's device type (``init_device_mesh``); needs the process
    group (``init_distributed()``)."""
    if not is_initialized():
        raise RuntimeError("initialize_mesh_device: no process group yet; call "
                           "deepspeed.init_distributed() first")
    from torch.distributed.device_mesh import init_device_mesh

    from dsrun.accelerator import get_accelerator

    names = tuple(mesh_dim_names) if mesh_dim_names is not None else None
    return init_device_mesh(get_accelerator().device_name(), tuple(mesh_shape),
                            mesh_dim_names=names)


def in_aml() -> bool:
    """Whether this runs in an Azure Machine Learning job."""
    return "AZUREML_EXPERIMENT_ID" in os.environ


def in_aws_sm() -> bool:
    """Whether this runs in an AWS SageMaker training job."""
    return "SM_TRAINING_ENV" in os.environ


def in_dlts() -> bool:
    """Whether this runs on a DLTS cluster."""
    return "DLTS_JOB_ID" in os.environ
