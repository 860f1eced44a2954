"""Monitors on 2 gloo ranks: one ``dsrun --cpu --num_gpus 2`` job, read back.

``job`` runs ``workers/monitor_job.py`` once for the module (stage 0 with
accumulation, then stage 3); the tests compare what the engine wrote with
what the script itself saw and measured, and plot the run directories.
"""

from __future__ import annotations

import csv
import importlib.util
import json
import os
import re
import struct
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import ROOT, dsrun_argv, run_dsrun

pytestmark = pytest.mark.dist

WORKER = ROOT / "tests" / "dist" / "workers" / "monitor_job.py"
LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                 "MASTER_PORT", "DSRUN_CONFIG", "DSRUN_JOB_ID")
STEPS, PRINT_EVERY = 12, 4
PHASES = ("stage0", "stage3")


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("monitor_job")
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS}
    res = subprocess.run(dsrun_argv("--cpu", "--num_gpus", "2", str(WORKER), "--out", str(out),
                                    "--steps", str(STEPS)),
                         capture_output=True, text=True, timeout=240, env=env, cwd=str(ROOT))
    assert res.returncode == 0, f"job failed ({res.returncode}):\n{res.stderr[-4000:]}"
    seen = {phase: json.loads((out / f"{phase}.json").read_text()) for phase in PHASES}
    return {"out": out, "stdout": res.stdout, "seen": seen}


def read_csv(path: Path) -> tuple[list[str], list[tuple[int, float]]]:
    with open(path, newline="") as handle:
        rows = list(csv.reader(handle))
    return rows[0], [(int(step), float(value)) for step, value in rows[1:]]


def series(job: dict[str, Any], phase: str, name: str) -> dict[int, float]:
    header, rows = read_csv(job["out"] / phase / f"Train_Samples_{name}.csv")
    assert header == ["step", name]
    assert len({step for step, _ in rows}) == len(rows)  # one row per step
    return dict(rows)


@pytest.mark.parametrize("phase", PHASES)
def test_csv_rows_equal_the_losses_the_script_saw(job: dict[str, Any], phase: str) -> None:
    seen = job["seen"][phase]
    assert seen["monitor_enabled"]
    loss = series(job, phase, "train_loss")
    assert list(loss) == [row["samples"] for row in seen["rows"]]
    assert list(loss) == [seen["train_batch_size"] * (i + 1) for i in range(STEPS)]
    for row in seen["rows"]:  # mean over the step's micro-batches and both ranks
        assert loss[row["samples"]] == pytest.approx(row["loss"], rel=1e-12, abs=1e-15)
    lr = series(job, phase, "lr")
    assert [lr[row["samples"]] for row in seen["rows"]] == [row["lr"][0] for row in seen["rows"]]
    norms = series(job, phase, "grad_norm")  # no clipping: measured before each step
    assert len(norms) == STEPS and all(0.0 < v < 1e3 for v in norms.values())
    info = json.loads((job["out"] / phase / "dsrun_run.json").read_text())
    assert info["train_batch_size"] == seen["train_batch_size"]
    assert info["data_parallel_size"] == 2 and info["zero_stage"] == (3 if phase == "stage3"
                                                                      else 0)


def test_only_rank_0_writes_the_scripts_own_events(job: dict[str, Any]) -> None:
    header, rows = read_csv(job["out"] / "stage0" / "Custom_writer_rank.csv")
    assert header == ["step", "writer_rank"]
    assert [value for _, value in rows] == [0.0] * STEPS  # rank 1's calls wrote nothing


@pytest.mark.parametrize(("phase", "tokens_per_sample"), [("stage0", 32), ("stage3", 7)])
def test_throughput_in_samples_and_tokens(job: dict[str, Any], phase: str,
                                          tokens_per_sample: int) -> None:
    samples = series(job, phase, "samples_per_sec")
    tokens = series(job, phase, "tokens_per_sec")
    assert len(samples) == STEPS and all(v > 0 for v in samples.values())
    # stage0 counts the (batch, seq=32) token ids; stage3 has dsrun.seq_length=7
    for step, value in samples.items():
        assert tokens[step] == pytest.approx(value * tokens_per_sample, rel=1e-9)


@pytest.mark.parametrize("phase", PHASES)
def test_breakdown_parts_add_up_to_the_measured_step(job: dict[str, Any], phase: str) -> None:
    rows = job["seen"][phase]["rows"]
    parts = {p: series(job, phase, f"elapsed_time_ms_{p}") for p in (
        "forward", "backward", "backward_inner", "backward_allreduce", "step", "monitor",
        "comm_reduce", "comm_gather", "iteration")}
    assert list(parts["forward"]) == [rows[i]["samples"]
                                      for i in range(PRINT_EVERY - 1, STEPS, PRINT_EVERY)]
    for end in range(PRINT_EVERY, STEPS + 1, PRINT_EVERY):
        interval = rows[end - PRINT_EVERY:end]
        at = interval[-1]["samples"]
        measured_ms = 1000.0 * sum(r["seconds"] for r in interval) / PRINT_EVERY
        total = parts["forward"][at] + parts["backward"][at] + parts["step"][at]
        assert abs(total - measured_ms) <= 0.10 * measured_ms, (phase, at, total, measured_ms)
        assert parts["backward_inner"][at] + parts["backward_allreduce"][at] == \
            pytest.approx(parts["backward"][at])
        assert 0.0 < parts["monitor"][at] < parts["step"][at]
        assert parts["iteration"][at] > 0.0
        assert parts["comm_reduce"][at] > 0.0  # 2 ranks: gradients are reduced
        if phase == "stage3":
            assert parts["comm_gather"][at] > 0.0  # parameters are gathered
        else:
            assert parts["comm_gather"][at] == 0.0
    lines = re.findall(r"\[\w+:0\] \[dsrun\] time \(ms per optimizer step, mean of 4\): "
                       r"forward [\d.]+ \| backward [\d.]+ \(communication wait [\d.]+\) \| "
                       r"step [\d.]+ \(monitor [\d.]+\) \| reduce wait", job["stdout"])
    assert len(lines) == 2 * STEPS // PRINT_EVERY  # rank 0 only, both phases


def test_tensorboard_event_file_reads_back(job: dict[str, Any]) -> None:
    if importlib.util.find_spec("tensorboard") is None:
        pytest.skip("the tensorboard package is not installed")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logdir = job["out"] / "tb" / "stage0"
    assert [p.name.startswith("events.out.tfevents.") for p in logdir.iterdir()] == [True]
    events = EventAccumulator(str(logdir), size_guidance={"scalars": 0})
    events.Reload()
    assert "Train/Samples/train_loss" in events.Tags()["scalars"]
    scalars = events.Scalars("Train/Samples/train_loss")
    csv_loss = series(job, "stage0", "train_loss")
    assert [s.step for s in scalars] == list(csv_loss)
    for scalar in scalars:  # TensorBoard stores float32
        assert scalar.value == pytest.approx(csv_loss[scalar.step], rel=1e-6)
    assert len(events.Scalars("Train/Samples/elapsed_time_ms_forward")) == STEPS // PRINT_EVERY


def test_plot_of_the_run_directories(job: dict[str, Any], tmp_path: Path) -> None:
    if importlib.util.find_spec("matplotlib") is None:
        pytest.skip("matplotlib (dsrun[plot]) is not installed")
    out = tmp_path / "both.png"
    res = run_dsrun("plot", str(job["out"]), "-o", str(out))  # output_path: both jobs
    assert res.returncode == 0, res.stderr
    assert "2 run(s), 5 panel(s)" in res.stdout
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    assert struct.unpack(">II", data[16:24]) == (1280, 1080)
    assert len(data) > 20_000
    empty = tmp_path / "empty"
    empty.mkdir()
    res = run_dsrun("plot", str(empty), "-o", str(tmp_path / "none.png"))
    assert res.returncode == 2 and "dsrun: error: no metrics in" in res.stderr
    assert not (tmp_path / "none.png").exists()
