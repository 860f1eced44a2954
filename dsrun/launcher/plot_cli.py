"""``dsrun plot RUN_DIR... [-o run.png]``: a picture of one or several runs.

Reads the CSV files ``csv_monitor`` wrote (:mod:`dsrun.runtime.monitor.runs`)
and draws one PNG (:mod:`dsrun.runtime.monitor.plot`, matplotlib - the
optional ``dsrun[plot]`` extra). Neither imports torch, and matplotlib is
imported only when a picture is drawn. Errors (a directory without
metrics, matplotlib missing, an output that cannot be written) end as one
``dsrun: error: ...`` line from :func:`dsrun.launcher.cli.main`.
"""

from __future__ import annotations

import click


@click.command("plot", context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("run_dirs", nargs=-1, required=True, metavar="RUN_DIR...")
@click.option("-o", "--output", "output", default="run.png", show_default=True,
              metavar="PNG", help="Where to write the picture.")
@click.option("--smooth", "smooth", type=float, default=0.6, show_default=True,
              help="Smoothing weight in [0, 1) for loss and throughput (TensorBoard's "
                   "moving average; 0 = none).")
def plot(run_dirs: tuple[str, ...], output: str, smooth: float) -> int:
    """Plot loss, learning rate, throughput, loss scale, gradient norm and the
    time breakdown of the runs in RUN_DIR (csv_monitor's output_path/job_name,
    or an output_path holding several jobs); several runs overlay."""
    from dsrun.runtime.monitor.plot import plot_runs
    from dsrun.runtime.monitor.runs import find_runs

    runs = find_runs(run_dirs)
    panels = plot_runs(runs, output, smooth)
    steps = max((len(s.x) for run in runs for s in run.series.values()), default=0)
    click.echo(f"dsrun plot: wrote {output} ({len(runs)} run(s), {panels} panel(s), "
               f"up to {steps} points per series)")
    return 0
