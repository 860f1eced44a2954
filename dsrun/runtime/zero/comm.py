"""The collectives of ZeRO stages 1/2, each done the way that is fastest on
the backend at hand.

Interface (``group`` None means the default group; world size 1 returns
without communicating):

* :func:`reduce_scatter_mean` ``(flat, group) -> shard``: ``flat`` (numel a
  multiple of the world size) holds this rank's contribution; the result is
  this rank's equal slice of the mean over the group. ``flat`` is scratch.
* :func:`all_gather_flat` ``(shard, group) -> flat``: every rank's shard,
  concatenated in rank order.
* :func:`start_reduce_to_owners` ``(buffer, ranges, group) -> Pending``: sum
  each ``(owner, start, length)`` range of ``buffer`` onto its owner (the
  stage-2 bucket reduction, where one bucket spans several owners unevenly).
* :func:`start_reduce_scatter` / :func:`start_all_gather`: the asynchronous
  forms; :class:`Pending` ``.wait()`` returns the result.

The mean is ``sum_r(x_r * (1/N))``: each contribution is multiplied by
``1/N`` before the sum, exactly as torch DDP's reducer does, so results
match DDP bitwise wherever the summation order does (always for 2 ranks).

How (:class:`CommStrategy`, looked up by backend in :data:`STRATEGIES`):

* **nccl**: ``reduce_scatter_single`` and ``all_gather_single`` (the
  non-deprecated names of ``reduce_scatter_tensor`` / ``all_gather_into_tensor``
  in torch 2.13; older torch falls back to those), and one ``reduce`` per
  owner for stage-2 buckets, as DeepSpeed does.
* **gloo** (and any other backend): ``all_reduce`` of the whole buffer,
  then keep this rank's slice; one ``broadcast`` per owner for the gather.
  Measured with ``bench/collectives.py`` (2 local ranks, fp32, torch 2.13
  CPU, ``OMP_NUM_THREADS=1``, on a shared 2-core machine, medians of 11
  interleaved runs, GB/s = buffer bytes / time, two runs)::

                               1 MB        10 MB        100 MB
      all_reduce + slice       0.5-1.1     0.9-1.2      0.94-0.99
      reduce_scatter_single    0.24-0.56   0.6-1.0      0.42-0.47
      reduce_scatter (list)    0.3         0.7-0.9      0.63-0.71
      reduce to each owner     0.4-0.75    1.0          0.81-0.95
      all_gather_single        1.1-1.25    1.5-2.1      0.51-0.57
      all_gather (list)        1.1-1.2     1.6          0.55-0.58
      broadcast from owners    1.2-1.7     1.0-2.6      2.03-2.15
      all_reduce-based gather  0.75-1.2    0.65-1.0     0.73-0.89

  gloo's tensor-form reduce-scatter is about half as fast as an all-reduce
  of the same buffer at 100 MB, and its all-gather a quarter as fast as one
  broadcast per owner: hence all_reduce + slice and broadcasts here.

Every strategy is valid on every backend, so tests force each one on gloo.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Optional

import torch
import torch.distributed as dist

from dsrun import comm as collectives
from dsrun.runtime.dist import backend_by_device
from dsrun.runtime.monitor.timers import comm_wait

_UNTIMED = contextlib.nullcontext()
REDUCE_STRATEGIES = ("all_reduce", "reduce_scatter")
OWNER_REDUCE_STRATEGIES = ("all_reduce", "reduce")
GATHER_STRATEGIES = ("all_gather", "broadcast")

# the coalesced gathers of stage 3 (partitioned.py) call torch directly: not logged
gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


@dataclass(frozen=True)
class CommStrategy:
    """How each ZeRO data movement is done (module docstring).

    ``reduce``: even reduce-scatter (:data:`REDUCE_STRATEGIES`);
    ``owner_reduce``: uneven per-owner ranges (:data:`OWNER_REDUCE_STRATEGIES`);
    ``gather``: all-gather (:data:`GATHER_STRATEGIES`).
    """

    reduce: str = "all_reduce"
    owner_reduce: str = "all_reduce"
    gather: str = "broadcast"

    def __post_init__(self) -> None:
        for name, value, valid in (("reduce", self.reduce, REDUCE_STRATEGIES),
                                   ("owner_reduce", self.owner_reduce, OWNER_REDUCE_STRATEGIES),
                                   ("gather", self.gather, GATHER_STRATEGIES)):
            if value not in valid:
                raise ValueError(f"CommStrategy.{name}={value!r}; valid: {', '.join(valid)}")


STRATEGIES: Mapping[str, CommStrategy] = MappingProxyType({
    "nccl": CommStrategy(reduce="reduce_scatter", owner_reduce="reduce", gather="all_gather"),
    "gloo": CommStrategy(reduce="all_reduce", owner_reduce="all_reduce", gather="broadcast"),
})
DEFAULT_STRATEGY = STRATEGIES["gloo"]  # needs only all_reduce and broadcast


def strategy_for_config(config: str, device_type: Optional[str] = None) -> CommStrategy:
    """The strategy for a group whose backend config is ``config``, for
    tensors of ``device_type`` (pure). None: the group's backend when it has
    one for every device, else its CPU backend."""
    per_device = backend_by_device(config)
    if device_type is not None and device_type in per_device:
        backend = per_device[device_type]
    elif len(set(per_device.values())) == 1:
        backend = next(iter(per_device.values()))
    else:
        backend = per_device.get("cpu", "")
    return STRATEGIES.get(backend, DEFAULT_STRATEGY)


# per live process group (weakly held: a destroyed group's entry goes with
# it), per device type: a group's backends never change, and stage 3 asks for
# every gradient (the config lookup and parse cost more than the collective
# bookkeeping around them)
_strategies: weakref.WeakKeyDictionary[Any, dict[Optional[str], CommStrategy]] = \
    weakref.WeakKeyDictionary()


def strategy_for(group: Any = None, device: Optional[torch.device] = None) -> CommStrategy:
    """The strategy for ``group``'s backend, for tensors on ``device``.

    Read from the group's backend config, not its name: a group made with
    no backend (``get_backend()`` says ``"undefined"``) is ``cuda:nccl`` on a
    GPU host, and one with several backends (``"cpu:gloo,cuda:nccl"``) uses
    nccl's strategy for CUDA tensors and gloo's for the others. Remembered
    per process group and device type.
    """
    device_type = device.type if device is not None else None
    key = group if group is not None else \
        (dist.group.WORLD if dist.is_initialized() else None)
    known = _strategies.get(key) if isinstance(key, dist.ProcessGroup) else None
    if known is not None and device_type in known:
        return known[device_type]
    found = strategy_for_config(dist.get_backend_config(group), device_type)
    if isinstance(key, dist.ProcessGroup):
        _strategies.setdefault(key, {})[device_type] = found
    return found


class Pending:
    """A collective in flight; :meth:`wait` returns its result (idempotent).
    ``kind`` ("reduce"/"gather") is what the wall-clock breakdown files its
    wait time under."""

    def __init__(self, result: torch.Tensor, works: Sequence[Any] = (),
                 finish: Optional[Any] = None, kind: str = "reduce") -> None:
        self._result = result
        self._works = list(works)
        self._finish = finish
        self._kind = kind

    def wait(self) -> torch.Tensor:
        works, self._works = self._works, []
        with comm_wait(self._kind) if works else _UNTIMED:
            for work in works:
                work.wait()
        if self._finish is not None:
            finish, self._finish = self._finish, None
            finish()
        return self._result


def _world_rank(group: Any) -> tuple[int, int]:
    return dist.get_world_size(group), dist.get_rank(group)


def _global(group: Any, rank: int) -> int:
    return dist.get_global_rank(group, rank) if group is not None else rank


def start_reduce_scatter(flat: torch.Tensor, group: Any = None, *,
                         strategy: Optional[CommStrategy] = None,
                         premultiplied: bool = False) -> Pending:
    """Start :func:`reduce_scatter_mean`. ``premultiplied``: ``flat`` already
    holds ``x * (1/N)`` (so only the sum remains)."""
    world, rank = _world_rank(group)
    if flat.dim() != 1 or flat.numel() % world:
        raise ValueError(f"reduce-scatter needs a 1-D tensor whose numel is a multiple of "
                         f"the world size {world}, got shape {tuple(flat.shape)}")
    shard_numel = flat.numel() // world
    mine = flat.narrow(0, rank * shard_numel, shard_numel)
    if world == 1:
        return Pending(mine)
    if not premultiplied:
        flat.mul_(1.0 / world)
    how = (strategy or strategy_for(group, flat.device)).reduce
    if how == "reduce_scatter":
        out = torch.empty_like(mine)
        return Pending(out, [collectives.reduce_scatter_tensor(out, flat, group=group,
                                                               async_op=True)])
    return Pending(mine, [collectives.all_reduce(flat, group=group, async_op=True)])


def reduce_scatter_mean(flat: torch.Tensor, group: Any = None, *,
                        strategy: Optional[CommStrategy] = None,
                        premultiplied: bool = False) -> torch.Tensor:
    """This rank's slice of the group mean of ``flat`` (module docstring);
    the result may be a view into ``flat``."""
    return start_reduce_scatter(flat, group, strategy=strategy,
                                premultiplied=premultiplied).wait()


def start_all_gather(shard: torch.Tensor, out: Optional[torch.Tensor] = None,
                     group: Any = None, *, strategy: Optional[CommStrategy] = None) -> Pending:
    """Start :func:`all_gather_flat`, into ``out`` (numel ``N * shard.numel()``)
    when given."""
    world, rank = _world_rank(group)
    n = shard.numel()
    if out is None:
        out = torch.empty(n * world, dtype=shard.dtype, device=shard.device)
    if out.dim() != 1 or out.numel() != n * world or out.dtype != shard.dtype:
        raise ValueError(f"all-gather output must be 1-D {shard.dtype} of {n * world} "
                         f"elements, got {out.dtype} {tuple(out.shape)}")
    if world == 1 or n == 0:  # n == 0: every rank's shard is empty (a zero-size parameter)
        out.copy_(shard.reshape(-1))
        return Pending(out)
    how = (strategy or strategy_for(group, shard.device)).gather
    if how == "all_gather":
        return Pending(out, [collectives.all_gather_into_tensor(
            out, shard.reshape(-1), group=group, async_op=True)], kind="gather")
    chunks = out.split(n)
    chunks[rank].copy_(shard.reshape(-1))
    works = [collectives.broadcast(chunks[r], src=_global(group, r), group=group, async_op=True)
             for r in range(world)]
    return Pending(out, works, kind="gather")


def all_gather_flat(shard: torch.Tensor, group: Any = None, *,
                    strategy: Optional[CommStrategy] = None,
                    out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Every rank's ``shard`` concatenated in rank order, on every rank."""
    return start_all_gather(shard, out, group, strategy=strategy).wait()


def merge_ranges(ranges: Sequence[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
    """Join ``(owner, start, length)`` ranges that continue each other with
    the same owner (pure; order kept)."""
    merged: list[tuple[int, int, int]] = []
    for owner, start, length in ranges:
        if merged and merged[-1][0] == owner and sum(merged[-1][1:]) == start:
            merged[-1] = (owner, merged[-1][1], merged[-1][2] + length)
        elif length > 0:
            merged.append((owner, start, length))
    return merged


def start_reduce_to_owners(buffer: torch.Tensor, ranges: Sequence[tuple[int, int, int]],
                           group: Any = None, *,
                           strategy: Optional[CommStrategy] = None) -> Pending:
    """Sum every ``(owner, start, length)`` range of ``buffer`` over the
    group onto ``owner`` (a group rank). After ``wait()`` this rank's own
    ranges hold the sums; other elements are unspecified. ``buffer`` must
    already hold each contribution times ``1/N`` for a mean."""
    world, _ = _world_rank(group)
    if world == 1:
        return Pending(buffer)
    how = (strategy or strategy_for(group, buffer.device)).owner_reduce
    if how == "all_reduce":
        return Pending(buffer, [collectives.all_reduce(buffer, group=group, async_op=True)])
    works = [collectives.reduce(buffer.narrow(0, start, length), dst=_global(group, owner),
                         group=group, async_op=True)
             for owner, start, length in merge_ranges(ranges)]
    return Pending(buffer, works)
