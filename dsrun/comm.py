"""``dsrun.comm``: what DeepSpeed scripts use as ``deepspeed.comm``.

``import dsrun as deepspeed`` then ``deepspeed.comm.get_rank()``, or
``from deepspeed import comm as dist`` (see :mod:`dsrun._alias`). The
collectives take ``torch.distributed``'s arguments plus DeepSpeed's
``prof``, ``log_name`` and ``debug`` keywords, and return what torch
returns (a work handle with ``async_op=True``).

dsrun's engine, ZeRO stages and pipelines communicate through these same
functions, so DeepSpeed's communication logger sees all of it: enable it
with ``"comms_logger": {"enabled": true}`` in the config (the engine calls
:func:`configure`) or :func:`configure` ``(enabled=True)``, train, then
:func:`log_summary` prints per operation and message size the count,
latencies and bandwidths (:mod:`dsrun.runtime.commlog` says how they are
measured: profiled operations run blocking). Not logged: the coalesced
all-gathers of stage 3 on NCCL (one launch for many parameters) and
torch's own collectives inside DDP or FSDP.

Rank queries: :func:`get_local_rank` is the rank on this host, from
dsrun's (or torchrun's ``LOCAL_RANK``, MPI's, Slurm's) environment.
"""

from __future__ import annotations

import datetime
import os
import time
from collections.abc import Callable, Sequence
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch.distributed import ReduceOp

from dsrun.runtime.commlog import LOGGER, straggler_analysis, straggler_ms, summary_table
from dsrun.runtime.dist import _mpi_world_size, init_distributed

__all__ = [
    "P2POp", "ReduceOp", "all_gather", "all_gather_coalesced", "all_gather_into_tensor",
    "all_gather_object", "all_reduce", "all_reduce_coalesced", "all_to_all",
    "all_to_all_single", "allgather_fn", "barrier", "batch_isend_irecv", "broadcast",
    "broadcast_object_list", "comms_logger", "configure", "destroy_process_group", "gather",
    "get_all_ranks_from_group", "get_comm_operation_count", "get_global_rank",
    "get_local_rank", "get_local_rank_from_launcher", "get_logged_comm_ops", "get_rank",
    "get_world_group", "get_world_rank_from_launcher", "get_world_size",
    "get_world_size_from_launcher",
    "has_all_gather_into_tensor", "has_all_reduce_coalesced", "has_coalescing_manager",
    "has_comm_data", "has_reduce_scatter_tensor", "inference_all_reduce", "init_distributed",
    "irecv", "is_available", "is_initialized", "isend", "log_summary", "monitored_barrier",
    "new_group", "recv", "reduce", "reduce_scatter", "reduce_scatter_fn",
    "reduce_scatter_tensor", "reset_log", "scatter", "send",
]

#: DeepSpeed's module-level logger object (``deepspeed.comm.comms_logger``):
#: ``.enabled``, ``.comms_dict`` (its records in DeepSpeed's layout), ...
comms_logger = LOGGER

# torch 2.13's non-deprecated names of the tensor-form collectives
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = (getattr(dist, "reduce_scatter_single", None)
                          or dist.reduce_scatter_tensor)


def _nbytes(tensor: Optional[torch.Tensor]) -> int:
    return tensor.numel() * tensor.element_size() if isinstance(tensor, torch.Tensor) else 0


def _list_bytes(tensors: Optional[Sequence[torch.Tensor]]) -> int:
    return sum(_nbytes(t) for t in tensors or ())


def _sync(tensor: Optional[torch.Tensor]) -> None:
    if isinstance(tensor, torch.Tensor) and tensor.is_cuda:
        torch.cuda.synchronize(tensor.device)


def _wait(result: Any) -> None:
    for work in result if isinstance(result, list) else [result]:
        if work is not None and hasattr(work, "wait"):
            work.wait()


class _TimedWork:
    """A point-to-point operation's work handle, timed until it completes:
    its entry is logged when the last handle of its call is waited on (or
    seen completed)."""

    def __init__(self, work: Any, finish: Callable[[], None]) -> None:
        self._work = work
        self._finish: Optional[Callable[[], None]] = finish

    def _done(self) -> None:
        finish, self._finish = self._finish, None
        if finish is not None:
            finish()

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        result = self._work.wait(*args, **kwargs)
        self._done()
        return result

    def is_completed(self) -> bool:
        completed = bool(self._work.is_completed())
        if completed:
            self._done()
        return completed

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)


def _call(kind: str, log_name: str, prof: bool, group: Any, size: Callable[[], int],
          device_of: Optional[torch.Tensor], fn: Callable[..., Any], /, *args: Any,
          point_to_point: bool = False, **kwargs: Any) -> Any:
    """Run ``fn(*args, **kwargs)``; when the logger profiles ``log_name``,
    blocking and timed, filed as operation ``kind``. Asynchronous
    ``point_to_point`` operations are not waited for here (an ``isend``
    waiting for its ``irecv``, posted after it by both ranks, would never
    return): they are timed until their handles complete."""
    if not LOGGER.enabled or not LOGGER.wants(log_name, prof):
        return fn(*args, **kwargs)
    name = LOGGER.name_for(log_name)
    _sync(device_of)
    start = time.perf_counter()
    result = fn(*args, **kwargs)
    if point_to_point:
        works = result if isinstance(result, list) else [result]
        left = [len(works)]

        def finish() -> None:
            left[0] -= 1
            if left[0] == 0:
                _sync(device_of)
                LOGGER.append(kind, name, time.perf_counter() - start, size(),
                              dist.get_world_size(group))
        timed = [_TimedWork(work, finish) for work in works]
        return timed if isinstance(result, list) else timed[0]
    _wait(result)
    _sync(device_of)
    elapsed = time.perf_counter() - start
    LOGGER.append(kind, name, elapsed, size(), dist.get_world_size(group))
    return result


# ------------------------------------------------------------ collectives


def all_reduce(tensor: torch.Tensor, op: Any = ReduceOp.SUM, group: Any = None,
               async_op: bool = False, prof: bool = False, log_name: str = "all_reduce",
               debug: Any = None) -> Any:
    return _call("all_reduce", log_name, prof, group, lambda: _nbytes(tensor), tensor,
                 dist.all_reduce, tensor, op=op, group=group, async_op=async_op)


def inference_all_reduce(tensor: torch.Tensor, op: Any = ReduceOp.SUM, group: Any = None,
                         async_op: bool = False, prof: bool = False,
                         log_name: str = "inference_all_reduce", debug: Any = None) -> Any:
    """DeepSpeed's low-latency all-reduce for inference: a plain all-reduce here."""
    return _call("inference_all_reduce", log_name, prof, group, lambda: _nbytes(tensor),
                 tensor, dist.all_reduce, tensor, op=op, group=group, async_op=async_op)


class _Done:
    """The handle of an operation that completed inside the call."""

    def wait(self, timeout: Any = None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


def all_reduce_coalesced(tensors: Sequence[torch.Tensor], op: Any = ReduceOp.SUM,
                         group: Any = None, async_op: bool = False, prof: bool = False,
                         log_name: str = "all_reduce_coalesced", debug: Any = None) -> Any:
    """All-reduce every tensor of ``tensors`` (one flat buffer, copied back;
    completed within the call, also with ``async_op``)."""
    tensors = list(tensors)

    def run() -> Any:
        flat = torch.cat([t.reshape(-1) for t in tensors])
        dist.all_reduce(flat, op=op, group=group)
        offset = 0
        for t in tensors:
            t.copy_(flat[offset:offset + t.numel()].view_as(t))
            offset += t.numel()
        return _Done() if async_op else None
    return _call("all_reduce_coalesced", log_name, prof, group,
                 lambda: _list_bytes(tensors), tensors[0] if tensors else None, run)


def broadcast(tensor: torch.Tensor, src: int, group: Any = None, async_op: bool = False,
              prof: bool = False, log_name: str = "broadcast", debug: Any = None) -> Any:
    return _call("broadcast", log_name, prof, group, lambda: _nbytes(tensor), tensor,
                 dist.broadcast, tensor, src=src, group=group, async_op=async_op)


def reduce(tensor: torch.Tensor, dst: int, op: Any = ReduceOp.SUM, group: Any = None,
           async_op: bool = False, prof: bool = False, log_name: str = "reduce",
           debug: Any = None) -> Any:
    return _call("reduce", log_name, prof, group, lambda: _nbytes(tensor), tensor,
                 dist.reduce, tensor, dst=dst, op=op, group=group, async_op=async_op)


def all_gather(tensor_list: list[torch.Tensor], tensor: torch.Tensor, group: Any = None,
               async_op: bool = False, prof: bool = False, log_name: str = "all_gather",
               debug: Any = None) -> Any:
    return _call("all_gather", log_name, prof, group, lambda: _nbytes(tensor), tensor,
                 dist.all_gather, tensor_list, tensor, group=group, async_op=async_op)


def all_gather_into_tensor(output_tensor: torch.Tensor, tensor: torch.Tensor,
                           group: Any = None, async_op: bool = False, prof: bool = False,
                           log_name: str = "all_gather_into_tensor", debug: Any = None) -> Any:
    return _call("all_gather_into_tensor", log_name, prof, group,
                 lambda: _nbytes(tensor), tensor, _all_gather_single, output_tensor,
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
        _wait(works)
        return None
    return _call("all_gather_coalesced", log_name, prof, group,
                 lambda: _list_bytes([inp for _, inp in pairs]),
                 pairs[0][1] if pairs else None, run)


def reduce_scatter_tensor(output_tensor: torch.Tensor, tensor: torch.Tensor,
                          op: Any = ReduceOp.SUM, group: Any = None, async_op: bool = False,
                          prof: bool = False, log_name: str = "reduce_scatter_tensor",
                          debug: Any = None) -> Any:
    return _call("reduce_scatter_tensor", log_name, prof, group, lambda: _nbytes(tensor),
                 tensor, _reduce_scatter_single, output_tensor, tensor, op=op, group=group,
                 async_op=async_op)


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
    return _call("reduce_scatter", log_name, prof, group, lambda: _list_bytes(input_list),
                 output, dist.reduce_scatter, output, input_list, op=op, group=group,
                 async_op=async_op)


def all_to_all_single(output: torch.Tensor, tensor: torch.Tensor,
                      output_split_sizes: Optional[list[int]] = None,
                      input_split_sizes: Optional[list[int]] = None, group: Any = None,
                      async_op: bool = False, prof: bool = False,
                      log_name: str = "all_to_all_single", debug: Any = None) -> Any:
    return _call("all_to_all_single", log_name, prof, group, lambda: _nbytes(tensor), tensor,
                 dist.all_to_all_single, output, tensor, output_split_sizes=output_split_sizes,
                 input_split_sizes=input_split_sizes, group=group, async_op=async_op)


def all_to_all(output_tensor_list: list[torch.Tensor], input_tensor_list: list[torch.Tensor],
               group: Any = None, async_op: bool = False, prof: bool = False,
               log_name: str = "all_to_all", debug: Any = None) -> Any:
    return _call("all_to_all", log_name, prof, group, lambda: _list_bytes(input_tensor_list),
                 input_tensor_list[0] if input_tensor_list else None, dist.all_to_all,
                 output_tensor_list, input_tensor_list, group=group, async_op=async_op)


def gather(tensor: torch.Tensor, gather_list: Optional[list[torch.Tensor]] = None, dst: int = 0,
           group: Any = None, async_op: bool = False, prof: bool = False,
           log_name: str = "gather", debug: Any = None) -> Any:
    return _call("gather", log_name, prof, group, lambda: _nbytes(tensor), tensor, dist.gather,
                 tensor, gather_list=gather_list, dst=dst, group=group, async_op=async_op)


def scatter(tensor: torch.Tensor, scatter_list: Optional[list[torch.Tensor]] = None,
            src: int = 0, group: Any = None, async_op: bool = False, prof: bool = False,
            log_name: str = "scatter", debug: Any = None) -> Any:
    return _call("scatter", log_name, prof, group, lambda: _nbytes(tensor), tensor,
                 dist.scatter, tensor, scatter_list=scatter_list, src=src, group=group,
                 async_op=async_op)


def all_gather_object(object_list: list[Any], obj: Any, group: Any = None, prof: bool = False,
                      log_name: str = "all_gather_object", debug: Any = None) -> Any:
    return _call("all_gather_object", log_name, prof, group, lambda: 0, None,
                 dist.all_gather_object, object_list, obj, group=group)


def broadcast_object_list(object_list: list[Any], src: int, group: Any = None,
                          device: Any = None, prof: bool = False,
                          log_name: str = "broadcast_object_list", debug: Any = None) -> Any:
    return _call("broadcast_object_list", log_name, prof, group, lambda: 0, None,
                 dist.broadcast_object_list, object_list, src=src, group=group, device=device)


def barrier(group: Any = None, async_op: bool = False, device_ids: Optional[list[int]] = None,
            prof: bool = False, log_name: str = "barrier", debug: Any = None) -> Any:
    return _call("barrier", log_name, prof, group, lambda: 0, None, dist.barrier, group=group,
                 async_op=async_op, device_ids=device_ids)


def monitored_barrier(group: Any = None, timeout: Optional[datetime.timedelta] = None,
                      wait_all_ranks: bool = False, prof: bool = False,
                      log_name: str = "monitored_barrier", debug: Any = None) -> Any:
    return _call("monitored_barrier", log_name, prof, group, lambda: 0, None,
                 dist.monitored_barrier, group=group, timeout=timeout,
                 wait_all_ranks=wait_all_ranks)


# ------------------------------------------------------------ point to point


def send(tensor: torch.Tensor, dst: int, group: Any = None, tag: int = 0, prof: bool = False,
         log_name: str = "send", debug: Any = None) -> Any:
    return _call("send", log_name, prof, group, lambda: _nbytes(tensor), tensor, dist.send,
                 tensor, dst=dst, group=group, tag=tag)


def recv(tensor: torch.Tensor, src: Optional[int] = None, group: Any = None, tag: int = 0,
         prof: bool = False, log_name: str = "recv", debug: Any = None) -> Any:
    return _call("recv", log_name, prof, group, lambda: _nbytes(tensor), tensor, dist.recv,
                 tensor, src=src, group=group, tag=tag)


def isend(tensor: torch.Tensor, dst: int, group: Any = None, tag: int = 0, prof: bool = False,
          log_name: str = "isend", debug: Any = None) -> Any:
    return _call("isend", log_name, prof, group, lambda: _nbytes(tensor), tensor, dist.isend,
                 tensor, dst=dst, group=group, tag=tag, point_to_point=True)


def irecv(tensor: torch.Tensor, src: Optional[int] = None, group: Any = None, tag: int = 0,
          prof: bool = False, log_name: str = "irecv", debug: Any = None) -> Any:
    return _call("irecv", log_name, prof, group, lambda: _nbytes(tensor), tensor, dist.irecv,
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
    return _call("batch_isend_irecv", log_name, prof, ops[0].group if ops else None,
                 lambda: sum(_nbytes(o.tensor) for o in ops), ops[0].tensor if ops else None,
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


def _launcher_env() -> Any:
    from dsrun.runtime.env import DistEnv

    return DistEnv.detect(mpi_size=_mpi_world_size)


def get_world_rank_from_launcher() -> int:
    """This process's global rank as the launcher set it (dsrun's or
    torchrun's ``RANK``, MPI's, Slurm's; 0 for a single process), with or
    without a process group."""
    return _launcher_env().rank


def get_world_size_from_launcher() -> int:
    """The job's world size as the launcher set it (1 for a single process)."""
    return _launcher_env().world_size


def get_local_rank_from_launcher() -> int:
    """This process's rank on its host as the launcher set it."""
    return _launcher_env().local_rank


def get_global_rank(group: Any = None, group_rank: int = 0) -> int:
    return dist.get_global_rank(group, group_rank) if group is not None else group_rank


def get_all_ranks_from_group(group: Any = None) -> list[int]:
    """The global ranks of ``group``'s members, in group-rank order."""
    if group is None:
        return list(range(get_world_size()))
    return [dist.get_global_rank(group, r) for r in range(dist.get_world_size(group))]


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


# ------------------------------------------------------------ the logger


def configure(deepspeed_config: Any = None, enabled: Optional[bool] = None,
              prof_all: Optional[bool] = None, prof_ops: Optional[list[str]] = None,
              verbose: Optional[bool] = None, debug: Optional[bool] = None) -> None:
    """Set up the communication logger (:mod:`dsrun.runtime.commlog`):
    from a resolved config's ``comms_logger`` section (``deepspeed_config``:
    a :class:`~dsrun.runtime.config.DsrunConfig`, or anything with a
    ``comms_logger`` attribute), then the keywords given."""
    section = getattr(deepspeed_config, "comms_logger", None)
    if section is not None and section.enabled:
        LOGGER.configure(enabled=True, prof_all=section.prof_all, prof_ops=section.prof_ops,
                         verbose=section.verbose, debug=section.debug)
    LOGGER.configure(enabled=enabled, prof_all=prof_all, prof_ops=prof_ops, verbose=verbose,
                     debug=debug)


def log_summary(show_straggler: bool = False, return_dict: bool = False
                ) -> Optional[dict[str, Any]]:
    """Print (rank 0) and/or return this rank's logged operations:
    ``{"summary": {log name: {size: {...}}}, "straggler_analysis": ...,
    "metadata": {...}}``, the analysis in DeepSpeed's layout
    (:func:`~dsrun.runtime.commlog.straggler_analysis`; the printed table's
    straggler column is the spread of the ranks' total latencies).
    Collective (barriers; with ``show_straggler`` an all-gather of every
    rank's latencies): every rank must call it."""
    grouped = is_initialized()
    if grouped:  # its own communication is not logged
        dist.barrier()
    summary = LOGGER.summary()
    spread = analysis = None
    if show_straggler:
        everyone: list[Any] = [LOGGER.latencies()]
        if grouped:
            everyone = [None] * dist.get_world_size()
            dist.all_gather_object(everyone, LOGGER.latencies())
        spread = straggler_ms([{key: sum(lats) for key, lats in ranks.items()}
                               for ranks in everyone])
        analysis = straggler_analysis(everyone, get_rank() if grouped else 0)
    if get_rank() == 0:
        print(summary_table(summary, spread), flush=True)
    if grouped:
        dist.barrier()
    if not return_dict:
        return None
    return {"summary": summary, "straggler_analysis": analysis,
            "metadata": {"world_size": get_world_size(), "rank": get_rank(),
                         "timestamp": datetime.datetime.now().isoformat(timespec="seconds")}}


def reset_log() -> None:
    """Forget every logged operation (e.g. per epoch)."""
    LOGGER.reset()


def has_comm_data() -> bool:
    return LOGGER.has_data()


def get_comm_operation_count() -> int:
    """Profiled operations logged so far (all names and sizes)."""
    return LOGGER.get_total_operations()


def get_logged_comm_ops() -> list[str]:
    return sorted(LOGGER.records)
