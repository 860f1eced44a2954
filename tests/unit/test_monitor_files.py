"""What the monitors hold between writes: the CSV writer's open files, the
exit hook's hold on a monitor, and what a failed CSV write leaves behind."""

from __future__ import annotations

import gc
import logging
import os
import resource
import subprocess
import sys
import textwrap
import weakref
from pathlib import Path
from typing import Any

import pytest

from dsrun.runtime.config import DsrunConfig, resolve
from dsrun.runtime.monitor import master
from dsrun.runtime.monitor.master import Monitor
from dsrun.runtime.monitor.writers import CsvWriter


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def enabled_config(tmp_path: Path) -> DsrunConfig:
    return resolve({"train_batch_size": 8,
                    "csv_monitor": {"enabled": True, "output_path": str(tmp_path)}},
                   dp_size=1, dp_source="test", environ={})


def test_more_event_names_than_the_descriptor_limit_are_all_written(tmp_path: Path) -> None:
    names = [f"Train/layer{i}/grad_norm" for i in range(120)]  # per-layer metrics
    writer = CsvWriter(str(tmp_path))
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    # room for 24 more descriptors: far fewer than the event names
    resource.setrlimit(resource.RLIMIT_NOFILE, (open_fds() + 24, hard))
    try:
        for step in (8, 16, 24):
            writer.write([(name, float(i), step) for i, name in enumerate(names)])
        held = open_fds()
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    writer.close()
    assert held < open_fds() + 24
    for i in (0, 57, 119):
        lines = (tmp_path / f"Train_layer{i}_grad_norm.csv").read_text().splitlines()
        assert lines == ["step,grad_norm", f"8,{float(i)}", f"16,{float(i)}", f"24,{float(i)}"]
    assert len(list(tmp_path.glob("Train_layer*_grad_norm.csv"))) == 120


def test_a_write_error_names_the_file_in_the_warning(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    if not os.path.exists("/dev/full"):
        pytest.skip("needs /dev/full (ENOSPC on every write)")
    (tmp_path / "Train_Samples_lr.csv").symlink_to("/dev/full")  # a full disk for one file
    monitor = Monitor(enabled_config(tmp_path), rank=0,
                      build=lambda c: [CsvWriter(str(tmp_path))])
    with caplog.at_level(logging.WARNING, logger="dsrun.runtime.monitor"):
        monitor.write_events([("Train/Samples/loss", 1.0, 8), ("Train/Samples/lr", 0.1, 8)])
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert warnings == [
        "csv_monitor: writing metrics failed (OSError: [Errno 28] No space left on device: "
        f"'{tmp_path / 'Train_Samples_lr.csv'}'); csv_monitor is off for the rest of this "
        "run, training goes on"]
    assert (tmp_path / "Train_Samples_loss.csv").read_bytes() == b"step,loss\r\n8,1.0\r\n"


def test_a_failed_write_leaves_no_half_row(tmp_path: Path) -> None:
    """A file size limit (RLIMIT_FSIZE, in a child process) cuts a write short
    part way through a row: the file ends at its last whole row."""
    path = tmp_path / "Train_Samples_loss.csv"
    path.write_bytes(b"step,loss\r\n8,1.0\r\n")
    size = path.stat().st_size
    script = textwrap.dedent(f"""
        import resource, signal
        from dsrun.runtime.monitor.writers import CsvWriter
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG instead of the signal
        resource.setrlimit(resource.RLIMIT_FSIZE, ({size} + 10, {size} + 10))
        try:
            CsvWriter({str(tmp_path)!r}).write([("Train/Samples/loss", 0.123456789, 16)])
        except OSError as err:
            print("error", err)
        """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=60, check=True).stdout
    assert out == f"error [Errno 27] File too large: '{path}'\n"
    assert path.read_bytes() == b"step,loss\r\n8,1.0\r\n"


class Closing:
    name = "fake"

    def __init__(self) -> None:
        self.closed = 0

    def write(self, events: Any) -> None:
        pass

    def close(self) -> None:
        self.closed += 1


def test_the_exit_hook_does_not_keep_a_monitor_alive(tmp_path: Path) -> None:
    writer = Closing()
    monitor = Monitor(enabled_config(tmp_path), rank=0, build=lambda c: [writer])
    alive = weakref.ref(monitor)
    del monitor
    gc.collect()
    assert alive() is None  # neither closed nor kept: freed with its writers


def test_the_exit_hook_closes_open_monitors_once(tmp_path: Path) -> None:
    kept, closed = Closing(), Closing()
    open_one = Monitor(enabled_config(tmp_path), rank=0, build=lambda c: [kept])
    closed_one = Monitor(enabled_config(tmp_path), rank=0, build=lambda c: [closed])
    closed_one.close()
    master._close_at_exit()  # what atexit runs
    assert kept.closed == 1 and closed.closed == 1 and not open_one.writers
