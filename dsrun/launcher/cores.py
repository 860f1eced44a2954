"""Binding each rank to its own CPU cores (``--bind_cores_to_rank``; pure).

DeepSpeed's launcher flags, with the same meaning: ``--bind_cores_to_rank``
gives each rank of a host an equal, disjoint, contiguous share of the
host's CPUs, in local-rank order, and sets its ``OMP_NUM_THREADS`` to the
share's size; ``--bind_core_list 0-7,16-23`` takes the shares from these
CPUs only (it implies ``--bind_cores_to_rank``). What a host may use is what
its node agent may run on (``sched_getaffinity``: a cgroup, ``taskset`` or
the batch system's binding), found by the preflight probe; CPUs left over
when the count does not divide are not used, as in DeepSpeed.

Ranks without binding share the host's CPUs and the operating system moves
their threads between them; with several ranks per host each rank's
OpenMP pool then competes for every core. Bound, a rank's threads stay on
its cores (cache and NUMA locality; no oversubscription between ranks).
The binding is applied by the rank process itself before anything else runs
(the injected runtime's first step, or the ``--no_python`` wrapper), from
``DSRUN_CPU_AFFINITY``, so every thread it starts later inherits it.
DeepSpeed also binds memory with ``numactl -m``; dsrun binds CPUs only:
Linux allocates a page on the NUMA node of the CPU that first touches it,
which for a bound rank is its own node.
"""

from __future__ import annotations

from collections.abc import Sequence

from dsrun.deathsig import AFFINITY_VAR, cpu_set, format_cpu_list
from dsrun.errors import DsrunUsageError

__all__ = ["AFFINITY_VAR", "format_cpu_list", "parse_cpu_list", "rank_cpus"]


def parse_cpu_list(text: str, where: str = "--bind_core_list") -> tuple[int, ...]:
    """``"0-3,8,10-11"`` -> ``(0, 1, 2, 3, 8, 10, 11)`` (sorted, each once)."""
    try:
        return tuple(sorted(cpu_set(text)))
    except ValueError as exc:
        raise DsrunUsageError(f"{where} {text!r}: {exc} (use e.g. 0-7,16-23)") from None


def rank_cpus(host: str, usable: Sequence[int], wanted: Sequence[int] | None,
              ranks: int) -> tuple[tuple[int, ...], ...]:
    """Each local rank's CPUs on ``host``: ``ranks`` equal contiguous shares
    of ``wanted`` (None: all of ``usable``), which must be CPUs the host may
    use."""
    allowed = sorted(set(usable))
    if wanted is None:
        chosen = allowed
        source = f"the {len(allowed)} CPU(s) it may use ({format_cpu_list(allowed)})"
    else:
        outside = sorted(set(wanted) - set(allowed))
        if outside:
            raise DsrunUsageError(
                f"--bind_core_list names CPU(s) {format_cpu_list(outside)} that host {host} "
                f"cannot use (it may use {format_cpu_list(allowed) or 'none'})")
        chosen = sorted(set(wanted))
        source = f"the {len(chosen)} CPU(s) of --bind_core_list"
    share = len(chosen) // ranks
    if share == 0:
        raise DsrunUsageError(f"--bind_cores_to_rank: host {host} runs {ranks} rank(s) but "
                              f"{source} give each less than one")
    return tuple(tuple(chosen[i * share:(i + 1) * share]) for i in range(ranks))
