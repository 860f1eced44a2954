"""``dsrun plot``: one PNG of one or several runs (matplotlib, no torch).

Panels, each drawn when some run has its series: loss (raw, thin, and
smoothed with TensorBoard's debiased exponential moving average; a
pipeline's eval_batch losses as points), learning
rate (every param group), throughput (samples/s, raw and smoothed; tokens/s
on a second axis), loss scale (fp16, log scale), gradient norm, and the
wall-clock breakdown (forward, backward split into compute and
communication wait, the optimizer step and the monitor's own work - and
for a pipeline also reading data, the receive waits, sends and the
tied-gradient reduction - stacked, with the measured iteration time on top; with several runs, per
run the timed total, the communication wait and the monitor's work).
Several runs share each panel, one colour per run, against one x unit
(samples as soon as one run has no batch size to count steps with). matplotlib is an
optional dependency: ``pip install matplotlib`` (from a checkout,
``.venv/bin/pip install -e '.[plot]'``; dsrun is not on PyPI).
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Callable, Optional

from dsrun.errors import DsrunError, DsrunUsageError
from dsrun.runtime.monitor import events as ev
from dsrun.runtime.monitor.runs import Run, Series, common_x, stem

PANEL_WIDTH_IN, PANEL_HEIGHT_IN, DPI = 6.4, 3.4, 100
OUTLIER_FACTOR = 4.0  # breakdown values above this many medians are drawn off scale
STACK = (("batch_input", "data input"), ("forward", "forward"),
         ("backward_inner", "backward compute"), ("backward_allreduce", "backward comm wait"),
         ("pipe_recv_input", "receive wait (activations)"),
         ("pipe_recv_grad", "receive wait (gradients)"), ("pipe_send", "send"),
         ("tied_reduce", "tied reduce"), ("step", "step"))  # pipeline parts when present


def smooth(values: Sequence[float], weight: float) -> list[float]:
    """TensorBoard's smoothing: an EMA debiased for its zero start."""
    if not 0.0 <= weight < 1.0:
        raise DsrunUsageError(f"--smooth must be in [0, 1), got {weight:g}")
    out, last, n = [], 0.0, 0
    for value in values:
        last = last * weight + (1.0 - weight) * value
        n += 1
        out.append(last / (1.0 - weight ** n) if weight else value)
    return out


def _matplotlib() -> Any:
    try:
        import matplotlib
        from matplotlib.figure import Figure
    except ImportError as err:
        raise DsrunError(f"dsrun plot needs matplotlib, which cannot be imported ({err}): "
                         "pip install matplotlib (or, in a dsrun checkout, "
                         ".venv/bin/pip install -e '.[plot]')") from None
    del matplotlib
    return Figure


@dataclass(frozen=True)
class Panel:
    title: str
    wanted: Callable[[Run], bool]
    draw: Callable[[Any, Sequence[Run], Sequence[Any], float], Optional[str]]  # -> a note


def _has(*names: str) -> Callable[[Run], bool]:
    return lambda run: any(run.get(n) is not None for n in names)


def _line(ax: Any, series: Series, **style: Any) -> None:
    ax.plot(series.x, series.values, **style)


def _draw_loss(ax: Any, runs: Sequence[Run], colors: Sequence[Any], weight: float) -> None:
    for run, color in zip(runs, colors):
        series = run.get(ev.TRAIN_LOSS)
        if series is None:
            continue
        _line(ax, series, color=color, alpha=0.3, linewidth=0.8)
        ax.plot(series.x, smooth(series.values, weight), color=color, linewidth=1.8,
                label=f"{run.label} (smoothed {weight:g})")
        evals = run.get(ev.EVAL_LOSS)
        if evals is not None:
            ax.plot(evals.x, evals.values, color=color, marker="o", linestyle="--",
                    label=f"{run.label} eval")
    values = [v for run in runs for v in getattr(run.get(ev.TRAIN_LOSS), "values", ())]
    if values and min(values) > 0 and max(values) / min(values) > 50:
        ax.set_yscale("log")  # losses that fall by orders of magnitude
    ax.set_ylabel("train loss")


def _draw_lr(ax: Any, runs: Sequence[Run], colors: Sequence[Any], weight: float) -> None:
    styles = ("-", "--", ":", "-.")
    for run, color in zip(runs, colors):
        groups = sorted(k for k in run.series if k == stem(ev.LR)
                        or k.startswith(stem(ev.LR) + "_group"))
        for i, key in enumerate(groups):
            name = "group 0" if key == stem(ev.LR) else key.rsplit("_", 1)[-1].replace(
                "group", "group ")
            _line(ax, run.series[key], color=color, linestyle=styles[i % len(styles)],
                  label=f"{run.label} {name}" if len(groups) > 1 else run.label)
    ax.set_ylabel("learning rate")
    ax.ticklabel_format(axis="y", style="sci", scilimits=(-3, 3))


def _tokens_per_sample(runs: Sequence[Run]) -> float:
    """The one tokens-per-sample ratio of every throughput point of ``runs``, or 0."""
    ratios = set()
    for run in runs:
        samples, tokens = run.get(ev.SAMPLES_PER_SEC), run.get(ev.TOKENS_PER_SEC)
        if samples is None or tokens is None or samples.x != tokens.x:
            return 0.0
        ratios.update(round(t / s, 6) for s, t in zip(samples.values, tokens.values) if s > 0)
    return ratios.pop() if len(ratios) == 1 else 0.0


def _draw_throughput(ax: Any, runs: Sequence[Run], colors: Sequence[Any],
                     weight: float) -> None:
    ratio = _tokens_per_sample(runs)
    tokens_ax = None
    for run, color in zip(runs, colors):
        samples = run.get(ev.SAMPLES_PER_SEC)
        if samples is not None:
            _line(ax, samples, color=color, alpha=0.3, linewidth=0.8)
            ax.plot(samples.x, smooth(samples.values, weight), color=color, linewidth=1.5,
                    label=f"{run.label} samples/s (smoothed {weight:g})")
        tokens = run.get(ev.TOKENS_PER_SEC)
        if tokens is not None and not ratio:
            tokens_ax = tokens_ax or ax.twinx()
            _line(tokens_ax, tokens, color=color, linestyle="--", alpha=0.7,
                  label=f"{run.label} tokens/s")
    ax.set_ylabel("samples/s")
    ax.set_ylim(bottom=0)
    if ratio:  # a fixed sequence length: tokens/s is the same curve, on its own scale
        secondary = ax.secondary_yaxis("right", functions=(lambda v: v * ratio,
                                                           lambda v: v / ratio))
        secondary.set_ylabel(f"tokens/s ({ratio:g} tokens per sample)")
    elif tokens_ax is not None:
        tokens_ax.set_ylabel("tokens/s (dashed)")
        tokens_ax.set_ylim(bottom=0)


def _draw_scalar(event: str, label: str, log: bool = False) -> Callable[..., None]:
    def draw(ax: Any, runs: Sequence[Run], colors: Sequence[Any], weight: float) -> None:
        for run, color in zip(runs, colors):
            series = run.get(event)
            if series is not None:
                _line(ax, series, color=color, label=run.label)
        ax.set_ylabel(label)
        if log:
            ax.set_yscale("log", base=2)
    return draw


def breakdown_parts(run: Run) -> list[tuple[str, tuple[float, ...], list[float]]]:
    """(label, x, ms) of the parts that add up to the timed step: forward,
    backward compute, backward communication wait, a pipeline's own parts,
    the optimizer step, and the monitor's own work when the run recorded it
    (it is inside "step")."""
    found = {part: run.get(ev.time_event(part)) for part, _ in STACK + (("monitor", ""),)}
    x = found["forward"].x if found["forward"] is not None else ()
    aligned = {part: list(s.values) for part, s in found.items() if s is not None and s.x == x}
    parts = []
    for part, label in STACK:
        if part not in aligned:
            continue
        values = aligned[part]
        if part == "step" and "monitor" in aligned:
            values = [max(v - m, 0.0) for v, m in zip(values, aligned["monitor"])]
            label = "optimizer step"
        parts.append((label, x, values))
    if "step" in aligned and "monitor" in aligned:
        parts.append(("monitor (inside step)", x, aligned["monitor"]))
    return parts


def _draw_breakdown(ax: Any, runs: Sequence[Run], colors: Sequence[Any],
                    weight: float) -> Optional[str]:
    timed = [(run, color) for run, color in zip(runs, colors)
             if run.get(ev.time_event("forward")) is not None]
    heights: list[float] = []
    if len(timed) == 1:
        parts = breakdown_parts(timed[0][0])
        ax.stackplot(parts[0][1], *[values for _, _, values in parts],
                     labels=[label for label, _, _ in parts], alpha=0.75)
        heights += [sum(v) for v in zip(*(values for _, _, values in parts))]
        iteration = timed[0][0].get(ev.time_event("iteration"))
        if iteration is not None:
            _line(ax, iteration, color="black", linewidth=1.2, label="iteration (measured)")
            heights += iteration.values
    for run, color in timed if len(timed) > 1 else ():  # per run: total, waits, monitor
        parts = breakdown_parts(run)
        x = parts[0][1]
        totals = [sum(v) for v in zip(*(values for _, _, values in parts))]
        heights += totals
        ax.plot(x, totals, color=color, label=f"{run.label} forward+backward+step")
        for (label, _, values) in parts:
            if "wait" in label or label.startswith("monitor"):
                ax.plot(x, values, color=color, linestyle=":" if "wait" in label else "--",
                        label=f"{run.label} {label}")
    ax.set_ylabel("ms per optimizer step")
    return _clip_outliers(ax, heights)


def _clip_outliers(ax: Any, heights: Sequence[float]) -> Optional[str]:
    """Keep a few huge intervals (start-up: imports, a first rendezvous) from
    flattening the rest: cut the axis above them and say so on the panel."""
    ordered = sorted(heights)
    median = ordered[len(ordered) // 2] if ordered else 0.0
    normal = [h for h in ordered if h <= OUTLIER_FACTOR * median]
    if not median or len(normal) == len(ordered):
        ax.set_ylim(bottom=0)
        return None
    ax.set_ylim(0, 1.5 * max(normal))
    return f"{len(ordered) - len(normal)} point(s) off scale, up to {ordered[-1]:.0f} ms"


PANELS = (
    Panel("loss", _has(ev.TRAIN_LOSS), _draw_loss),
    Panel("learning rate", _has(ev.LR), _draw_lr),
    Panel("throughput", _has(ev.SAMPLES_PER_SEC, ev.TOKENS_PER_SEC), _draw_throughput),
    Panel("loss scale (fp16)", _has(ev.LOSS_SCALE), _draw_scalar(ev.LOSS_SCALE, "loss scale",
                                                                  log=True)),
    Panel("gradient norm", _has(ev.GRAD_NORM), _draw_scalar(ev.GRAD_NORM, "global grad norm")),
    Panel("time breakdown (mean per print interval)", _has(ev.time_event("forward")),
          _draw_breakdown),
)


def plot_runs(runs: Sequence[Run], output: str, smooth_weight: float = 0.6) -> int:
    """Draw ``runs`` into the PNG ``output``; returns the number of panels."""
    if not output.lower().endswith(".png"):
        raise DsrunUsageError(f"-o {output!r}: dsrun plot writes PNG files; end the name "
                              "with .png")
    smooth([], smooth_weight)  # validates the weight before any drawing
    runs = common_x(runs)  # one x unit per axis: never steps and samples mixed
    panels = [p for p in PANELS if any(p.wanted(run) for run in runs)]
    if not panels:
        keys = sorted({k for run in runs for k in run.series})
        raise DsrunUsageError("none of the training metrics dsrun plots are in these runs "
                              f"(found: {', '.join(keys)}); expected e.g. "
                              f"{stem(ev.TRAIN_LOSS)}.csv")
    Figure = _matplotlib()
    columns = 1 if len(panels) == 1 else 2
    rows = math.ceil(len(panels) / columns)
    fig = Figure(figsize=(PANEL_WIDTH_IN * columns, PANEL_HEIGHT_IN * rows + 0.6), dpi=DPI,
                 layout="constrained")
    colors = [f"C{i % 10}" for i in range(len(runs))]
    for index, panel in enumerate(panels):
        ax = fig.add_subplot(rows, columns, index + 1)
        note = panel.draw(ax, runs, colors, smooth_weight)
        ax.set_title(panel.title + (f"\n({note})" if note else ""))
        ax.set_xlabel(runs[0].x_label)
        ax.grid(True, alpha=0.3)
        handles, _ = ax.get_legend_handles_labels()
        if handles:
            ax.legend(fontsize="small", loc="best")
    fig.suptitle("dsrun: " + ", ".join(run.label for run in runs))
    _save(fig, output)
    return len(panels)


def _save(fig: Any, output: str) -> None:
    directory = os.path.dirname(os.path.abspath(output))
    if not os.path.isdir(directory):
        raise DsrunUsageError(f"-o {output!r}: the directory {directory!r} does not exist")
    try:
        fig.savefig(output, format="png")
    except OSError as err:
        raise DsrunUsageError(f"-o {output!r}: cannot write the PNG: {err.strerror or err}"
                              ) from None
