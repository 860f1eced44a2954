"""DeepSpeed's communication logger (``"comms_logger"`` in the config).

Every collective and point-to-point operation of :mod:`dsrun.comm` - which
is also what dsrun's engine, ZeRO stages and pipelines communicate through -
can be timed and counted per operation and message size. Off by default:
then an operation costs one attribute check more than calling
``torch.distributed`` directly.

**What is logged.** With ``enabled``, an operation is *profiled* when
``prof_all`` is on (the default), when its ``log_name`` is in ``prof_ops``,
or when the call passes ``prof=True``. A profiled operation runs blocking:
asynchronous ones are waited for inside the call (on a GPU the device is
synchronised before and after), so its latency is its own, not the compute
it would have overlapped - DeepSpeed does the same, and training runs slower
while everything is profiled. ``verbose`` prints one line per operation;
``debug`` appends the calling function's name to the log name.

**Sizes and bandwidths.** The message size an operation is filed under
is DeepSpeed's: the bytes of its input tensor - one rank's contribution for
the all-gathers, the whole input for reductions (a reduce-scatter's input,
an all-reduce's tensor), one tensor for broadcast, reduce, gather, scatter
and point-to-point - and the sum of the input lists for the list forms.
Bandwidths follow nccl-tests: ``algbw = data / latency``, where ``data``
is the message size, except for the all-gathers, whose data is the whole
gathered result (size x ``n``, as DeepSpeed multiplies it);
``busbw`` corrects it for the bytes each rank actually moves:
``algbw * 2(n-1)/n`` for all-reduce, ``algbw * (n-1)/n`` for all-gather,
reduce-scatter and all-to-all, ``algbw`` for the rest (``n``: the group's
size). Reported in Gbit/s, as DeepSpeed does. Object collectives (``all_gather_object``,
``broadcast_object_list``) and barriers are counted and timed with size 0.

:class:`CommsLogger` holds the records and does the arithmetic (no
processes); :func:`summary_table` formats them. The cross-rank part
(``log_summary``'s barrier and straggler analysis) is in :mod:`dsrun.comm`.
"""

from __future__ import annotations

import inspect
import logging
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Optional

# under dsrun.runtime: printed (rank 0) once ensure_visible() has run
log = logging.getLogger("dsrun.runtime.comm")

SIZE_UNITS = ("B", "KB", "MB", "GB", "TB", "PB", "EB", "ZB", "YB")
ALL_REDUCE_OPS = frozenset({"all_reduce", "inference_all_reduce", "all_reduce_coalesced"})
# Filed under one rank's input; their bandwidth counts the gathered result.
GATHER_OPS = frozenset({"all_gather", "all_gather_into_tensor", "all_gather_coalesced"})
SCATTER_GATHER_OPS = frozenset({
    "all_gather", "all_gather_into_tensor", "reduce_scatter", "reduce_scatter_tensor",
    "all_to_all", "all_to_all_single", "all_gather_coalesced"})


def _is_first_rank() -> bool:
    """Global rank 0, or no process group (DeepSpeed prints these lines on rank 0)."""
    import torch.distributed as dist

    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


def bus_factor(op: str, world_size: int) -> float:
    """busbw / algbw for ``op`` on ``world_size`` ranks (module docstring)."""
    n = max(world_size, 1)
    if op in ALL_REDUCE_OPS:
        return 2 * (n - 1) / n
    if op in SCATTER_GATHER_OPS:
        return (n - 1) / n
    return 1.0


def data_bytes(op: str, size: int, world_size: int) -> int:
    """The bytes ``algbw`` counts for an ``op`` filed under ``size`` (module
    docstring): the gathered result for all-gathers, else ``size``."""
    return size * max(world_size, 1) if op in GATHER_OPS else size


def bandwidths(op: str, size: int, world_size: int, seconds: float) -> tuple[float, float]:
    """(algbw, busbw) in Gbit/s of one ``op`` of message size ``size``."""
    algbw = gbps(data_bytes(op, size, world_size), seconds)
    return algbw, algbw * bus_factor(op, world_size)


def gbps(size_bytes: int, seconds: float) -> float:
    """Gigabits per second for ``size_bytes`` in ``seconds`` (0 when no time)."""
    return size_bytes * 8 / seconds / 1e9 if seconds > 0 else 0.0


def size_str(size_bytes: int) -> str:
    """``size_bytes`` as DeepSpeed's logger writes it (its ``convert_size``):
    in the largest power-of-1024 unit, rounded to 2 decimals, ``"0B"``,
    ``"8.0 B"``, ``"1.0 KB"``, ``"1.5 MB"``."""
    if size_bytes <= 0:
        return "0B"
    power = min(int(math.floor(math.log(size_bytes, 1024))), len(SIZE_UNITS) - 1)
    return f"{round(size_bytes / 1024 ** power, 2)} {SIZE_UNITS[power]}"


@dataclass
class OpRecord:
    """One (log name, message size): every profiled call's latency."""

    op: str  # the operation (``all_reduce``)
    size: int  # bytes
    world_size: int
    latencies: list[float] = field(default_factory=list)  # seconds

    def as_dict(self) -> dict[str, Any]:
        total = sum(self.latencies)
        count = len(self.latencies)
        average = total / count if count else 0.0
        algbw, busbw = bandwidths(self.op, self.size, self.world_size, average)
        return {"count": count, "total_latency_ms": total * 1e3,
                "avg_latency_ms": average * 1e3, "tput_avg_gbps": algbw,
                "busbw_avg_gbps": busbw,
                "msg_size_bytes": self.size, "msg_size_str": size_str(self.size)}


class CommsLogger:
    """The records of one process (module docstring)."""

    def __init__(self) -> None:
        self.enabled = False
        self.verbose = False
        self.prof_all = True
        self.debug = False
        self.prof_ops: list[str] = []
        self.records: dict[str, dict[int, OpRecord]] = {}

    def configure(self, *, enabled: Optional[bool] = None, prof_all: Optional[bool] = None,
                  prof_ops: Optional[Iterable[str]] = None, verbose: Optional[bool] = None,
                  debug: Optional[bool] = None) -> None:
        """Change the given settings only (DeepSpeed's ``comm.configure``)."""
        if enabled is not None:
            self.enabled = bool(enabled)
        if prof_all is not None:
            self.prof_all = bool(prof_all)
        if prof_ops is not None:
            if isinstance(prof_ops, str):
                raise TypeError("prof_ops must be a list of operation names, not a string")
            self.prof_ops = list(prof_ops)
        if verbose is not None:
            self.verbose = bool(verbose)
        if debug is not None:
            self.debug = bool(debug)

    def wants(self, log_name: str, prof: bool) -> bool:
        """Whether a call logged as ``log_name`` is profiled."""
        return self.enabled and (prof or self.prof_all or log_name in self.prof_ops)

    def name_for(self, log_name: str, depth: int = 3) -> str:
        """``log_name``, with the caller's function name under ``debug``
        (``depth``: frames between the collective's caller and here)."""
        if not self.debug:
            return log_name
        frame = inspect.currentframe()
        for _ in range(depth):
            frame = frame.f_back if frame is not None else None
        caller = frame.f_code.co_name if frame is not None else "?"
        return f"{log_name} | [Caller Func: {caller}]"

    def append(self, op: str, log_name: str, seconds: float, size: int,
               world_size: int) -> None:
        record = self.records.setdefault(log_name, {}).get(size)
        if record is None:
            record = self.records[log_name][size] = OpRecord(op, size, world_size)
        record.latencies.append(seconds)
        if self.verbose and _is_first_rank():
            from dsrun.runtime.progress import ensure_visible
            ensure_visible()
            algbw, busbw = bandwidths(op, size, world_size, seconds)
            log.info("comm op: %s | time (ms): %.2f | msg size: %s | algbw (Gbps): %.2f | "
                     "busbw (Gbps): %.2f", log_name, seconds * 1e3, size_str(size), algbw,
                     busbw)

    def reset(self) -> None:
        self.records = {}

    # DeepSpeed's CommsLogger API (``deepspeed.comm.comms_logger``)

    @property
    def comms_dict(self) -> dict[str, dict[int, list[Any]]]:
        """The records in DeepSpeed's layout, a snapshot: log name -> message
        size -> ``[count, [latency ms], [algbw Gbps], [busbw Gbps]]``, one
        entry per call in the lists."""
        out: dict[str, dict[int, list[Any]]] = {}
        for name, by_size in self.records.items():
            for size, rec in by_size.items():
                bws = [bandwidths(rec.op, size, rec.world_size, s) for s in rec.latencies]
                out.setdefault(name, {})[size] = [
                    len(rec.latencies), [s * 1e3 for s in rec.latencies],
                    [a for a, _ in bws], [b for _, b in bws]]
        return out

    def get_raw_data(self) -> dict[str, dict[int, list[Any]]]:
        return self.comms_dict

    def has_data(self) -> bool:
        return bool(self.records)

    def reset_data(self) -> None:
        self.reset()

    def get_operation_names(self) -> list[str]:
        return list(self.records)

    def get_total_operations(self) -> int:
        return sum(len(rec.latencies) for by_size in self.records.values()
                   for rec in by_size.values())

    def start_profiling_comms(self) -> None:
        self.prof_all = True

    def stop_profiling_comms(self) -> None:
        self.prof_all = False

    def start_profiling_op(self, op_name_list: Iterable[str]) -> None:
        self.prof_ops = sorted(set(self.prof_ops) | set(op_name_list))

    def stop_profiling_op(self, op_name_list: Iterable[str]) -> None:
        drop = set(op_name_list)
        self.prof_ops = [op for op in self.prof_ops if op not in drop]

    def summary(self) -> dict[str, dict[int, dict[str, Any]]]:
        """log name -> message size -> :meth:`OpRecord.as_dict`."""
        return {name: {size: rec.as_dict() for size, rec in sorted(by_size.items())}
                for name, by_size in sorted(self.records.items())}

    def latencies(self) -> dict[tuple[str, int], list[float]]:
        """(log name, size) -> every logged call's latency in seconds."""
        return {(name, size): list(rec.latencies) for name, by_size in self.records.items()
                for size, rec in by_size.items()}

    def totals(self) -> dict[tuple[str, int], float]:
        """(log name, size) -> total latency in seconds (for straggler analysis)."""
        return {(name, size): sum(rec.latencies) for name, by_size in self.records.items()
                for size, rec in by_size.items()}


def straggler_ms(totals_per_rank: Iterable[Mapping[tuple[str, int], float]]
                 ) -> dict[str, dict[int, float]]:
    """log name -> size -> straggler effect in ms: the slowest rank's total
    latency minus the fastest rank's, over the ranks that logged it. A
    rank that waits in a collective for a late peer shows the peer's delay
    as latency; the spread between ranks measures that delay."""
    spread: dict[tuple[str, int], list[float]] = {}
    for totals in totals_per_rank:
        for key, seconds in totals.items():
            spread.setdefault(key, []).append(seconds)
    out: dict[str, dict[int, float]] = {}
    for (name, size), values in sorted(spread.items()):
        out.setdefault(name, {})[size] = (max(values) - min(values)) * 1e3
    return out


def trimmed_mean(values: Iterable[float], trim: float = 0.1) -> float:
    """The mean without the lowest and highest ``trim`` share of ``values``
    (DeepSpeed's ``trim_mean``, rounding the share as it does; all of them
    where nothing would be left; 0 for none)."""
    ordered = sorted(values)
    cut = int(round(len(ordered) * trim))
    kept = ordered[cut:len(ordered) - cut] or ordered
    return sum(kept) / len(kept) if kept else 0.0


def straggler_analysis(latencies_per_rank: list[Mapping[tuple[str, int], list[float]]],
                       rank: int) -> dict[str, dict[int, dict[str, Any]]]:
    """DeepSpeed's ``straggler_analysis`` for ``rank``: for each (log name,
    size) it logged, the latency of each call is compared with the fastest
    rank's for the same call (the element-wise minimum over the ranks that
    logged it, on the calls they all made): ``total_comm_lat_ms`` sums those
    minima, ``total_straggler_ms`` this rank's excess over them (its waiting
    for late peers), the averages are 10 %-trimmed means (pure)."""
    out: dict[str, dict[int, dict[str, Any]]] = {}
    for key, mine in sorted(latencies_per_rank[rank].items()):
        others = [lats[key] for lats in latencies_per_rank if key in lats]
        calls = min(len(lats) for lats in others)
        fastest = [min(lats[i] for lats in others) * 1e3 for i in range(calls)]
        excess = [mine[i] * 1e3 - fastest[i] for i in range(calls)]
        name, size = key
        out.setdefault(name, {})[size] = {
            "count": len(mine), "total_comm_lat_ms": sum(fastest),
            "total_straggler_ms": sum(excess), "avg_comm_lat_ms": trimmed_mean(fastest),
            "avg_straggler_ms": trimmed_mean(excess), "msg_size_bytes": size,
            "msg_size_str": size_str(size)}
    return out


def summary_table(summary: Mapping[str, Mapping[int, Mapping[str, Any]]],
                  straggler: Optional[Mapping[str, Mapping[int, float]]] = None) -> str:
    """The table ``log_summary`` prints: one block per operation, one row
    per message size."""
    head = (f"{'Comm. Op':<30}{'Message Size':>14}{'Count':>8}{'Total Latency(ms)':>19}"
            f"{'Avg Latency(ms)':>17}{'tput_avg (Gbps)':>17}{'busbw_avg (Gbps)':>18}")
    if straggler is not None:
        head += f"{'straggler (ms)':>16}"
    lines = [head]
    for name, by_size in summary.items():
        lines.append(name)
        for size, row in by_size.items():
            line = (f"{'':<30}{row['msg_size_str']:>14}{row['count']:>8}"
                    f"{row['total_latency_ms']:>19.2f}{row['avg_latency_ms']:>17.3f}"
                    f"{row['tput_avg_gbps']:>17.2f}{row['busbw_avg_gbps']:>18.2f}")
            if straggler is not None:
                line += f"{straggler.get(name, {}).get(size, 0.0):>16.2f}"
            lines.append(line)
    return "\n".join(lines)


LOGGER = CommsLogger()
