"""Read run directories back: the CSV files ``csv_monitor`` writes (pure, no torch).

A run directory is one ``output_path/job_name`` directory holding
``Train_Samples_*.csv`` files (DeepSpeed's layout, :mod:`events`); a
directory without CSV files whose subdirectories hold them (an
``output_path`` with several jobs) gives one run per subdirectory.

Steps: the engine's events carry ``global_samples``. When dsrun wrote the
directory, its ``dsrun_run.json`` gives ``train_batch_size`` and the
samples become optimizer steps; a directory DeepSpeed wrote is read with
samples on the x axis; runs of both kinds plotted together are all drawn
against samples (:func:`common_x`). Files are appended to by every run that writes
into the directory (as DeepSpeed does), so a later row for a step replaces
an earlier one (a run resumed from a checkpoint rewrites the steps after
it) and the points are sorted by step. Rows that are not two numbers (a
header repeated by a resumed DeepSpeed run, a line cut short by a crash)
are skipped; non-finite values are dropped.
"""

from __future__ import annotations

import csv
import json
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Optional

from dsrun.errors import DsrunUsageError
from dsrun.runtime.monitor.events import CSV_SUFFIX, RUN_INFO, csv_filename


def stem(event_name: str) -> str:
    """The key a series is read back under: its CSV file name without ``.csv``."""
    return csv_filename(event_name)[: -len(CSV_SUFFIX)]


@dataclass(frozen=True)
class Series:
    """One CSV file: x values (steps or samples) and the values."""

    key: str
    header: str
    x: tuple[float, ...]
    values: tuple[float, ...]


@dataclass(frozen=True)
class Run:
    label: str
    path: str
    x_label: str
    series: Mapping[str, Series]
    info: Mapping[str, Any]

    def get(self, event_name: str) -> Optional[Series]:
        return self.series.get(stem(event_name))


def _csv_files(path: str) -> list[str]:
    try:
        names = sorted(os.listdir(path))
    except OSError as err:
        raise DsrunUsageError(f"cannot read run directory {path!r}: {err.strerror}") from None
    return [n for n in names if n.endswith(CSV_SUFFIX) and os.path.isfile(os.path.join(path, n))]


def run_dirs(path: str) -> list[str]:
    """``path`` itself when it holds CSV files, else its subdirectories that do."""
    if not os.path.isdir(path):
        raise DsrunUsageError(f"run directory {path!r} does not exist or is not a directory")
    if _csv_files(path):
        return [path]
    subdirs = sorted(os.path.join(path, n) for n in os.listdir(path)
                     if os.path.isdir(os.path.join(path, n)))
    return [d for d in subdirs if _csv_files(d)]


def _read_info(path: str) -> dict[str, Any]:
    try:
        with open(os.path.join(path, RUN_INFO), encoding="utf-8") as handle:
            info = json.load(handle)
    except (OSError, ValueError):
        return {}
    return info if isinstance(info, dict) else {}


def _read_series(path: str, name: str, per_step: Optional[float]) -> Optional[Series]:
    points: dict[float, float] = {}
    header = name[: -len(CSV_SUFFIX)]
    with open(os.path.join(path, name), newline="", encoding="utf-8", errors="replace") as f:
        for row in csv.reader(f):
            if len(row) != 2:
                continue
            try:
                x, value = float(row[0]), float(row[1])
            except ValueError:
                if row[0] == "step":
                    header = row[1]
                continue
            if math.isfinite(x) and math.isfinite(value):
                points[x] = value  # a later row for the same step wins (a resumed run)
    if not points:
        return None
    xs = sorted(points)
    key = name[: -len(CSV_SUFFIX)]
    return Series(key, header, tuple(x / per_step if per_step else x for x in xs),
                  tuple(points[x] for x in xs))


def read_run(path: str, label: Optional[str] = None) -> Run:
    info = _read_info(path)
    batch = info.get("train_batch_size")
    per_step = float(batch) if isinstance(batch, (int, float)) and batch > 0 else None
    series = {}
    for name in _csv_files(path):
        read = _read_series(path, name, per_step)
        if read is not None:
            series[read.key] = read
    return Run(label or os.path.basename(os.path.normpath(path)), path,
               "optimizer step" if per_step else "samples", MappingProxyType(series),
               MappingProxyType(info))


def find_runs(paths: Sequence[str]) -> list[Run]:
    """Every run under ``paths`` that has metrics, or a clear error."""
    runs = []
    for path in paths:
        dirs = run_dirs(path)
        found = [read_run(d) for d in dirs]
        found = [r for r in found if r.series]
        if not found:
            raise DsrunUsageError(
                f"no metrics in {path!r}: dsrun plot reads the CSV files that csv_monitor "
                f"writes (e.g. {csv_filename('Train/Samples/train_loss')}), in the directory "
                'or its subdirectories; enable them with "csv_monitor": {"enabled": true, '
                '"output_path": ..., "job_name": ...} in the config')
        runs.extend(found)
    return _unique_labels(runs)


def _parts(path: str) -> list[str]:
    return [p for p in os.path.abspath(path).split(os.sep) if p]


def _suffix_labels(paths: Sequence[str]) -> list[str]:
    """Each path's shortest trailing part (``job``, ``exp1/csv/job``...)
    that no other path ends with at the same length; the same directory
    given twice gets one label."""
    parts = [_parts(p) for p in paths]
    labels = []
    for i, mine in enumerate(parts):
        others = [p for j, p in enumerate(parts) if j != i and p != mine]
        depth = 1
        while depth < len(mine) and any(o[-depth:] == mine[-depth:] for o in others):
            depth += 1
        labels.append("/".join(mine[-depth:]))
    return labels


def _unique_labels(runs: list[Run]) -> list[Run]:
    labels = _suffix_labels([r.path for r in runs])
    return [Run(label, r.path, r.x_label, r.series, r.info) for label, r in zip(labels, runs)]


def in_samples(run: Run) -> Run:
    """``run`` against samples: a run read in optimizer steps (dsrun's, with
    its ``train_batch_size``) has its steps multiplied back."""
    batch = run.info.get("train_batch_size")
    if run.x_label == "samples" or not isinstance(batch, (int, float)) or batch <= 0:
        return run
    series = {key: Series(s.key, s.header, tuple(x * batch for x in s.x), s.values)
              for key, s in run.series.items()}
    return Run(run.label, run.path, "samples", MappingProxyType(series), run.info)


def common_x(runs: Sequence[Run]) -> list[Run]:
    """``runs`` on one x unit: optimizer steps when every run has them, else
    samples (a DeepSpeed run has no batch size to turn samples into steps)."""
    if len({r.x_label for r in runs}) <= 1:
        return list(runs)
    return [in_samples(r) for r in runs]
