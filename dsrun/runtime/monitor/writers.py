"""One writer per monitor backend, each with ``write(events)`` and ``close()``.

A writer's constructor does everything the config can make fail - the
backend's package is missing, the output directory cannot be created - and
raises :class:`DsrunConfigError` naming the section and the config's
source. ``write`` may raise anything: :class:`~dsrun.runtime.monitor.master.Monitor`
catches it. Only rank 0 builds writers. torch (for TensorBoard), wandb and
comet_ml are imported when such a writer is built, never at module import.
"""

from __future__ import annotations

import contextlib
import csv
import importlib
import importlib.util
import io
import json
import os
from collections.abc import Sequence
from typing import Any, Optional, Protocol

from dsrun.errors import DsrunConfigError
from dsrun.runtime.monitor.events import RUN_INFO, Event, csv_filename, csv_header

INSTALL_HINTS = {
    "tensorboard": "pip install tensorboard",
    "wandb": "pip install wandb (then `wandb login`, or WANDB_MODE=offline to write locally)",
    "comet_ml": "pip install comet_ml (then an api_key, COMET_API_KEY, or \"online\": false)",
}
# The package each monitor section needs (csv_monitor needs none).
PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb", "comet": "comet_ml"}


class Writer(Protocol):
    name: str

    def write(self, events: Sequence[Event]) -> None: ...

    def close(self) -> None: ...


def require(package: str, section: str, source: str) -> Any:
    """Import ``package`` for an enabled ``section`` or fail naming both."""
    try:
        return importlib.import_module(package)
    except ImportError as err:
        raise DsrunConfigError(
            f'"{section}" is enabled in {source} but the {package} package is not installed '
            f"({err}): {INSTALL_HINTS.get(package, f'pip install {package}')}, or set "
            f'"{section}": {{"enabled": false}}') from None


def make_log_dir(output_path: str, job_name: str, section: str, source: str) -> str:
    """``output_path/job_name``, created (DeepSpeed's layout; "" = the cwd)."""
    path = os.path.join(output_path, job_name)
    where = (f'{section}.output_path {output_path!r} with job_name {job_name!r} '
             f"(in {source})")
    try:
        os.makedirs(path or ".", exist_ok=True)
    except OSError as err:
        raise DsrunConfigError(f"{where}: cannot create the directory {path!r}: "
                               f"{err.strerror or err}") from None
    if not os.access(path or ".", os.W_OK | os.X_OK):
        raise DsrunConfigError(f"{where}: the directory {path!r} is not writable")
    return path


class CsvWriter:
    """DeepSpeed's CSV layout (see :mod:`events`). Each ``write`` opens the
    files its events go to, appends their rows and closes them again, as
    DeepSpeed does: no file stays open between writes, so a run with
    thousands of event names (per-layer metrics) needs no more descriptors
    than one, and every row is on disk, readable while training runs, once
    ``write`` returns. ``info`` goes to ``dsrun_run.json`` beside them (for
    ``dsrun plot``)."""

    name = "csv_monitor"

    def __init__(self, log_dir: str, info: Optional[dict[str, Any]] = None) -> None:
        self.log_dir = log_dir
        if info is not None:
            path = os.path.join(log_dir, RUN_INFO)
            with open(path + ".tmp", "w", encoding="utf-8") as handle:
                json.dump(info, handle, indent=1, sort_keys=True)
            os.replace(path + ".tmp", path)

    def write(self, events: Sequence[Event]) -> None:
        """Append each event's row to its file; an :class:`OSError` (disk
        full, out of descriptors) is raised naming the file it hit."""
        rows: dict[str, tuple[str, list[list[Any]]]] = {}  # file -> (header, rows), in order
        for name, value, step in events:
            filename = csv_filename(name)
            rows.setdefault(filename, (csv_header(name), []))[1].append([step, value])
        for filename, (header, lines) in rows.items():
            path = os.path.join(self.log_dir, filename)
            try:
                _append_rows(path, header, lines)
            except OSError as err:
                if err.filename is not None:
                    raise
                # a write error has no file name: the warning must say which file
                raise OSError(err.errno, err.strerror or str(err), path) from err

    def close(self) -> None:
        """Nothing stays open between writes."""


def _append_rows(path: str, header: str, rows: list[list[Any]]) -> None:
    """Append ``rows`` to the CSV file ``path`` (``header`` first when the file
    is new or empty, so a resumed run does not repeat it) and close it. A
    failed write is cut back off, so the file never ends in half a row."""
    with open(path, "ab", buffering=0) as handle:  # unbuffered: every write is seen here
        start = handle.tell()  # append mode starts at the end: the file's size
        text = io.StringIO(newline="")
        lines = csv.writer(text)
        if start == 0:
            lines.writerow(["step", header])
        lines.writerows(rows)
        data = memoryview(text.getvalue().encode("utf-8"))
        try:
            while data:
                data = data[handle.write(data):]
        except OSError:
            with contextlib.suppress(OSError):  # best effort: the error below says what failed
                handle.truncate(start)
            raise


class TensorBoardWriter:
    """``torch.utils.tensorboard.SummaryWriter(log_dir)``; ``add_scalar``
    per event, flushed after every ``write`` (as DeepSpeed does)."""

    name = "tensorboard"

    def __init__(self, log_dir: str, source: str) -> None:
        require("tensorboard", self.name, source)
        from torch.utils.tensorboard import SummaryWriter

        self.log_dir = log_dir
        self.summary_writer = SummaryWriter(log_dir=log_dir)

    def write(self, events: Sequence[Event]) -> None:
        for name, value, step in events:
            self.summary_writer.add_scalar(name, value, step)
        self.summary_writer.flush()

    def close(self) -> None:
        self.summary_writer.close()


class WandbWriter:
    """``wandb.init(project=, group=, entity=team)``; the events of one step
    go in one ``log`` call (wandb wants steps that never decrease)."""

    name = "wandb"

    def __init__(self, project: str, group: Any, team: Any, source: str) -> None:
        wandb = require("wandb", self.name, source)
        self.run = wandb.init(project=project, group=group, entity=team)

    def write(self, events: Sequence[Event]) -> None:
        batch: dict[str, float] = {}
        current = None
        for name, value, step in events:
            if batch and step != current:
                self.run.log(batch, step=current)
                batch = {}
            batch[name], current = value, step
        if batch:
            self.run.log(batch, step=current)

    def close(self) -> None:
        self.run.finish()


class CometWriter:
    """A Comet experiment (``comet_ml.start``); each event name is logged
    the first time it comes, then whenever ``samples_log_interval`` samples
    or more have passed since it was last logged (DeepSpeed's
    ``EventsLogScheduler``)."""

    name = "comet"

    def __init__(self, section: Any, source: str) -> None:
        comet_ml = require("comet_ml", self.name, source)
        options = {key: getattr(section, key)
                   for key in ("api_key", "project", "workspace", "experiment_key", "mode",
                               "online")
                   if getattr(section, key) is not None}
        self._interval = section.samples_log_interval
        self._last_logged: dict[str, int] = {}
        self.experiment = comet_ml.start(**options)
        if section.experiment_name:
            self.experiment.set_name(section.experiment_name)

    def write(self, events: Sequence[Event]) -> None:
        for name, value, step in events:
            last = self._last_logged.get(name)
            if last is None or step - last >= self._interval:
                self._last_logged[name] = step
                self.experiment.log_metric(name, value, step=step)

    def close(self) -> None:
        self.experiment.end()


def run_info(config: Any) -> dict[str, Any]:
    """What a reader of the CSV files needs to know about the run."""
    return {"train_batch_size": config.train_batch_size,
            "train_micro_batch_size_per_gpu": config.train_micro_batch_size_per_gpu,
            "gradient_accumulation_steps": config.gradient_accumulation_steps,
            "data_parallel_size": config.dp_size, "zero_stage": config.zero_optimization.stage,
            "precision": config.precision, "seq_length": config.dsrun.seq_length,
            "steps_per_print": config.steps_per_print, "step_unit": "global_samples"}


def check_package(section: str, source: str) -> None:
    """Fail (on every rank, without importing anything) when the enabled
    ``section``'s package is missing; a section needing none passes."""
    package = PACKAGES.get(section)
    if package is None:
        return
    try:
        found = importlib.util.find_spec(package) is not None
    except (ImportError, ValueError):  # a module entry of None or without a spec
        found = False
    if not found:
        require(package, section, source)  # raises with the import error


def check_packages(config: Any) -> None:
    """:func:`check_package` for each enabled monitor section of ``config``."""
    for section in PACKAGES:
        if getattr(config, section).enabled:
            check_package(section, config.source)


def build_writers(config: Any) -> list[Writer]:
    """The writers ``config``'s enabled monitor sections ask for (rank 0).

    Packages and directories are checked for every section before any
    writer starts, so a bad section leaves nothing half-started.
    """
    source = config.source
    check_packages(config)
    for section, package in PACKAGES.items():
        if getattr(config, section).enabled:
            require(package, section, source)
    dirs = {section: make_log_dir(getattr(config, section).output_path,
                                  getattr(config, section).job_name, section, source)
            for section in ("tensorboard", "csv_monitor") if getattr(config, section).enabled}
    writers: list[Writer] = []
    try:
        if "tensorboard" in dirs:
            writers.append(TensorBoardWriter(dirs["tensorboard"], source))
        if config.wandb.enabled:
            wb = config.wandb
            writers.append(WandbWriter(wb.project, wb.group, wb.team, source))
        if config.comet.enabled:
            writers.append(CometWriter(config.comet, source))
        if "csv_monitor" in dirs:
            writers.append(CsvWriter(dirs["csv_monitor"], run_info(config)))
    except BaseException:
        for writer in writers:
            writer.close()
        raise
    return writers
