"""What the flops profiler measured, per module, and the text it prints.

Pure: a :class:`ModuleStats` tree (built by :mod:`.flops_profiler` while a
model runs) and functions that turn it into DeepSpeed-style report text -
the summary block, the top modules per depth ("aggregated profile") and
the module tree with each module's share ("detailed profile") - plus the
number formatting helpers DeepSpeed exports (``flops_to_string``...).

A module's counts include its children's (a module's forward contains its
children's forwards); ``own_*`` holds what ran in the module's own code.
``duration`` is what was measured around the module's own calls;
``latency`` is what the reports show (the children's sum where the module
itself was never called).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Optional

__all__ = [
    "ModuleStats", "Summary", "aggregate_by_depth", "detailed_lines", "duration_to_string",
    "flops_to_string", "macs_to_string", "number_to_string", "params_to_string",
    "aggregated_lines", "summary_lines",
]

_UNITS = ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "K"))


def number_to_string(num: float, units: Optional[str] = None, precision: int = 2) -> str:
    """``12.35 M`` (``824`` below a thousand); ``units`` forces one of
    ``T G M K`` (or ``""`` for none)."""
    if units is None:
        for scale, unit in _UNITS:
            if abs(num) >= scale:
                return f"{round(num / scale, precision):g} {unit}"
        return f"{round(num, precision):g}"
    scale = dict((u, s) for s, u in _UNITS).get(units, 1.0)
    return f"{round(num / scale, precision):g} {units}".rstrip()


def _with_unit(num: float, units: Optional[str], precision: int, suffix: str) -> str:
    text = number_to_string(num, units, precision)
    return f"{text}{suffix}" if text[-1].isalpha() else f"{text} {suffix}"


def flops_to_string(flops: float, units: Optional[str] = None, precision: int = 2) -> str:
    """``1.5 GFLOPS``."""
    return _with_unit(flops, units, precision, "FLOPS")


def macs_to_string(macs: float, units: Optional[str] = None, precision: int = 2) -> str:
    """``3.07 KMACs``."""
    return _with_unit(macs, units, precision, "MACs")


def params_to_string(params: float, units: Optional[str] = None, precision: int = 2) -> str:
    return number_to_string(params, units, precision)


def duration_to_string(seconds: float, units: Optional[str] = None, precision: int = 2) -> str:
    """``1.23 ms``; ``units`` one of ``s ms us``."""
    if units is None:
        units = "s" if seconds >= 1 else "ms" if seconds >= 1e-3 else "us"
    factor = {"s": 1.0, "ms": 1e3, "us": 1e6}[units]
    return f"{round(seconds * factor, precision):g} {units}"


@dataclass
class ModuleStats:
    """One module of the profiled model (``name`` as in ``named_modules``;
    ``""`` is the root). ``calls`` counts its forwards while profiling."""

    name: str
    kind: str
    params: int = 0
    extra: str = ""
    own_flops: int = 0
    own_macs: int = 0
    duration: float = 0.0
    calls: int = 0
    children: list[ModuleStats] = field(default_factory=list)

    @property
    def flops(self) -> int:
        return self.own_flops + sum(c.flops for c in self.children)

    @property
    def macs(self) -> int:
        return self.own_macs + sum(c.macs for c in self.children)

    @property
    def latency(self) -> float:
        """Its measured forward time; for a module never called itself (a
        ``ModuleList``, a container whose parent calls the children), the
        sum of its children's, as DeepSpeed reports it."""
        if self.calls or not self.children:
            return self.duration
        return sum(c.latency for c in self.children)

    def walk(self, depth: int = 0) -> Iterator[tuple[int, ModuleStats]]:
        """``(depth, stats)`` for this module and every descendant, parents first."""
        yield depth, self
        for child in self.children:
            yield from child.walk(depth + 1)


@dataclass(frozen=True)
class Summary:
    """The figures of one profiled optimizer step on one rank.

    Forward flops are counted per module; backward flops are counted too
    (every op of the backward pass, recomputation by activation
    checkpointing included), not estimated from the forward."""

    step: int
    world_size: int
    dp_size: int
    micro_batches: int
    samples: int
    params: int
    fwd_flops: int
    fwd_macs: int
    bwd_flops: int
    fwd_latency: float
    bwd_latency: Optional[float]
    step_latency: Optional[float]
    stage: Optional[tuple[int, int]] = None  # (stage, stages) of a pipeline


def _ratio(flops: float, seconds: Optional[float]) -> str:
    if not seconds:
        return "n/a"
    return flops_to_string(flops / seconds)


def summary_lines(s: Summary) -> list[str]:
    """The summary block: sizes, counts, latencies and achieved FLOPS."""
    rows: list[tuple[str, str]] = [
        ("world size", str(s.world_size)),
        ("data parallel size", str(s.dp_size)),
        *([("pipeline stage (its layers only)", f"{s.stage[0]} of {s.stage[1]}")]
          if s.stage else []),
        ("micro-batches profiled", str(s.micro_batches)),
        ("samples per rank", str(s.samples) if s.samples else "unknown"),
        ("params per rank", params_to_string(s.params)),
        ("fwd MACs per rank", macs_to_string(s.fwd_macs)),
        ("fwd flops per rank", number_to_string(s.fwd_flops)),
        ("bwd flops per rank (counted)", number_to_string(s.bwd_flops)),
        ("fwd latency", duration_to_string(s.fwd_latency)),
    ]
    if s.bwd_latency is not None:
        rows.append(("bwd latency", duration_to_string(s.bwd_latency)))
    rows.append(("fwd FLOPS per rank = fwd flops / fwd latency",
                 _ratio(s.fwd_flops, s.fwd_latency)))
    if s.bwd_latency is not None:
        rows.append(("bwd FLOPS per rank = bwd flops / bwd latency",
                     _ratio(s.bwd_flops, s.bwd_latency)))
        rows.append(("fwd+bwd FLOPS per rank", _ratio(s.fwd_flops + s.bwd_flops,
                                                      s.fwd_latency + s.bwd_latency)))
    if s.step_latency is not None and s.bwd_latency is not None:
        iteration = s.fwd_latency + s.bwd_latency + s.step_latency
        rows += [("step latency", duration_to_string(s.step_latency)),
                 ("iter latency = fwd + bwd + step", duration_to_string(iteration)),
                 ("FLOPS per rank = (fwd + bwd flops) / iter latency",
                  _ratio(s.fwd_flops + s.bwd_flops, iteration))]
        if s.samples:
            rows.append(("samples/second per rank", f"{s.samples / iteration:.2f}"))
    width = max(len(k) for k, _ in rows) + 2
    return [f"{k + ':':<{width}}{v}" for k, v in rows]


def aggregate_by_depth(root: ModuleStats) -> dict[int, dict[str, ModuleStats]]:
    """Per depth, the modules of each class summed into one entry (as
    DeepSpeed's aggregated profile groups them)."""
    out: dict[int, dict[str, ModuleStats]] = {}
    for depth, stats in root.walk():
        group = out.setdefault(depth, {})
        total = group.setdefault(stats.kind, ModuleStats(stats.kind, stats.kind))
        total.params += stats.params
        total.own_flops += stats.flops
        total.own_macs += stats.macs
        total.duration += stats.latency
    return out


def aggregated_lines(root: ModuleStats, module_depth: int = -1, top_modules: int = 1
                     ) -> list[str]:
    """The top ``top_modules`` classes per depth by params, MACs and latency."""
    lines = ["Top modules in terms of params, MACs or fwd latency at different model depths:"]
    by_depth = aggregate_by_depth(root)
    for depth in sorted(by_depth):
        if module_depth >= 0 and depth > module_depth:
            break
        group = list(by_depth[depth].values())
        lines.append(f"depth {depth}:")
        for label, key, show in (
                ("params", lambda m: m.params, lambda m: params_to_string(m.params)),
                ("MACs", lambda m: m.own_macs, lambda m: macs_to_string(m.own_macs)),
                ("fwd latency", lambda m: m.duration, lambda m: duration_to_string(m.duration))):
            top = sorted(group, key=key, reverse=True)[:max(top_modules, 0)]
            shown = ", ".join(f"{m.kind}: {show(m)}" for m in top)
            lines.append(f"    {label:<12}- {shown}")
    return lines


def _share(part: float, whole: float) -> str:
    return f"{100.0 * part / whole:.2f}%" if whole else "0%"


def detailed_lines(root: ModuleStats, module_depth: int = -1) -> list[str]:
    """The module tree, each module with params, MACs, latency (and their
    share of the model's) and the FLOPS it achieved."""
    total_params, total_macs, total_time = root.params, root.macs, root.latency
    lines = ["Each module: params (share), MACs (share), fwd latency (share), FLOPS, extra"]
    for depth, m in root.walk():
        if module_depth >= 0 and depth > module_depth:
            continue
        label = m.name.rsplit(".", 1)[-1] if m.name else "(model)"
        flops_rate = flops_to_string(m.flops / m.latency) if m.latency else "n/a"
        fields = [f"{params_to_string(m.params)} = {_share(m.params, total_params)} Params",
                  f"{macs_to_string(m.macs)} = {_share(m.macs, total_macs)} MACs",
                  f"{duration_to_string(m.latency)} = {_share(m.latency, total_time)} latency",
                  flops_rate]
        if m.extra:
            fields.append(m.extra)
        lines.append(f"{'  ' * depth}{label}: {m.kind}({', '.join(fields)})")
    return lines
