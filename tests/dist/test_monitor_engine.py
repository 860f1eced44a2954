"""Monitors through the engine at world size 1 (one in-process gloo group).

Failure handling, fp16's loss scale, param groups, the measured gradient
norm, seq_length, errors at initialize, and wandb in offline mode; the
2-rank behaviour is in test_monitor_job.py.
"""

from __future__ import annotations

import csv
import gc
import glob
import importlib.machinery
import importlib.util
import logging
import os
import resource
import sys
import threading
from pathlib import Path
from typing import Any, Optional

import pytest
import torch

import dsrun
from dsrun.errors import DsrunConfigError, DsrunError

pytestmark = pytest.mark.dist


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))


def config(out: Path, job: str = "run", **extra: Any) -> dict[str, Any]:
    return {"train_micro_batch_size_per_gpu": 4, "steps_per_print": 100,
            "optimizer": {"type": "Adam", "params": {"lr": 1e-2}},
            "csv_monitor": {"enabled": True, "output_path": str(out), "job_name": job}, **extra}


def train(engine: Any, steps: int, inputs: Optional[torch.Tensor] = None) -> list[float]:
    gen = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        x = torch.randn(4, 6, generator=gen) if inputs is None else inputs
        if x.is_floating_point():  # fp16 models take fp16 inputs
            x = x.to(next(engine.module.parameters()).dtype)
        loss = engine(x).float().square().mean()
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def column(path: Path) -> list[float]:
    with open(path, newline="") as handle:
        return [float(value) for _, value in list(csv.reader(handle))[1:]]


def test_a_write_failing_after_the_start_warns_once_and_training_goes_on(
        solo: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    engine, *_ = dsrun.initialize(model=model(), config=config(tmp_path))
    from deepspeed.monitor.monitor import MonitorMaster

    assert isinstance(engine.monitor, MonitorMaster)  # as DeepSpeed's engine.monitor
    # DeepSpeed's MonitorMaster attributes: the enabled backend's writer, else None
    assert engine.monitor.csv_monitor is not None and engine.monitor.tb_monitor is None
    assert engine.monitor.wandb_monitor is None and engine.monitor.comet_monitor is None
    losses = train(engine, 3)
    lr_file = tmp_path / "run" / "Train_Samples_lr.csv"
    lr_file.unlink()
    lr_file.symlink_to("/dev/full")  # the disk is full from now on (ENOSPC on write)
    with caplog.at_level(logging.WARNING, logger="dsrun.runtime.monitor"):
        losses += train(engine, 5)
        engine.monitor.write_events([("Custom/x", 1.0, 1)])  # no writer left: a no-op
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert warnings == ["csv_monitor: writing metrics failed (OSError: [Errno 28] No space left "
                        f"on device: '{lr_file}'); csv_monitor is off for the rest of this run, "
                        "training goes on"]
    assert engine.global_steps == 8 and len(losses) == 8
    assert engine.monitor.csv_monitor is None  # switched off after the failure
    assert column(tmp_path / "run" / "Train_Samples_train_loss.csv") == \
        pytest.approx(losses[:4], rel=1e-12)  # step 4's loss went before the lr failed


def test_more_event_names_than_the_descriptor_limit_are_all_logged(
        solo: None, tmp_path: Path) -> None:
    """Per-layer metrics, 150 names, under a descriptor limit leaving 32 free."""
    engine, *_ = dsrun.initialize(model=model(), config=config(tmp_path))
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (open_fds() + 32, hard))
    try:
        losses = []
        for step in range(1, 4):
            losses += train(engine, 1)
            engine.monitor.write_events([(f"Train/layer{i}/grad_norm", float(i), step)
                                         for i in range(150)])
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert engine.monitor.csv_monitor is not None  # never switched off
    run = tmp_path / "run"
    assert column(run / "Train_Samples_train_loss.csv") == pytest.approx(losses, rel=1e-12)
    for i in range(150):
        assert column(run / f"Train_layer{i}_grad_norm.csv") == [float(i)] * 3


def test_destroyed_engines_leave_no_files_or_threads_open(solo: None, tmp_path: Path) -> None:
    """Engines with csv and tensorboard (an open event file and a writer thread
    each), built, trained and destroyed in turn: descriptors and threads stay flat."""
    if importlib.util.find_spec("tensorboard") is None:
        pytest.skip("the tensorboard package is not installed")
    counts = []
    for i in range(4):
        cfg = config(tmp_path, f"e{i}", tensorboard={"enabled": True,
                                                     "output_path": str(tmp_path / "tb"),
                                                     "job_name": f"e{i}"})
        engine, *_ = dsrun.initialize(model=model(), config=cfg)
        train(engine, 2)
        engine.destroy()
        assert engine.monitor.tb_monitor is None and engine.monitor.csv_monitor is None
        del engine
        gc.collect()
        counts.append((open_fds(), threading.active_count()))
    assert counts[1:] == counts[:1] * 3
    assert column(tmp_path / "e3" / "Train_Samples_train_loss.csv")  # it did write


def test_fp16_writes_the_loss_scale_and_the_steps_own_gradient_norm(
        solo: None, tmp_path: Path) -> None:
    cfg = config(tmp_path, fp16={"enabled": True, "initial_scale_power": 8})
    engine, *_ = dsrun.initialize(model=model(), config=cfg)
    losses = train(engine, 4)
    run = tmp_path / "run"
    assert column(run / "Train_Samples_loss_scale.csv") == [256.0] * 4
    assert column(run / "Train_Samples_train_loss.csv") == pytest.approx(losses, rel=1e-12)
    assert column(run / "Train_Samples_grad_norm.csv")[-1] == \
        pytest.approx(engine.get_global_grad_norm(), rel=1e-12)


@pytest.mark.parametrize("stage", [0, 1])
def test_lr_per_group_and_the_measured_norm_equals_the_clipping_norm(
        solo: None, tmp_path: Path, stage: int) -> None:
    norms = []
    for clip in (0.0, 1e9):  # 1e9 never clips: the same training, the step's own norm
        net = model()
        groups = [{"params": net[0].parameters()}, {"params": net[2].parameters(), "lr": 5e-3}]
        job = f"clip{clip:g}"
        cfg = config(tmp_path, job, gradient_clipping=clip, zero_optimization={"stage": stage})
        engine, *_ = dsrun.initialize(model=net, model_parameters=groups, config=cfg)
        train(engine, 4)
        # DeepSpeed's rule: ZeRO stages always report the norm, stage 0 in fp32 only clipping
        assert (engine.get_global_grad_norm() is None) == (clip == 0.0 and stage == 0)
        norms.append(column(tmp_path / job / "Train_Samples_grad_norm.csv"))
        assert column(tmp_path / job / "Train_Samples_lr.csv") == [1e-2] * 4
        assert column(tmp_path / job / "Train_Samples_lr_group1.csv") == [5e-3] * 4
    assert len(norms[0]) == 4 and norms[0] == pytest.approx(norms[1], rel=1e-6)


def test_tokens_from_seq_length_or_counted_ids(solo: None, tmp_path: Path) -> None:
    engine, *_ = dsrun.initialize(model=model(), config=config(tmp_path, "floats"))
    train(engine, 2)  # float inputs, no seq_length: no tokens/s
    assert not (tmp_path / "floats" / "Train_Samples_tokens_per_sec.csv").exists()
    engine.monitor.seq_length = 5
    train(engine, 2)
    samples = column(tmp_path / "floats" / "Train_Samples_samples_per_sec.csv")
    tokens = column(tmp_path / "floats" / "Train_Samples_tokens_per_sec.csv")
    assert len(samples) == 4 and tokens == pytest.approx([s * 5 for s in samples[2:]])

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Embedding(10, 6), torch.nn.Linear(6, 1))
    engine, *_ = dsrun.initialize(model=net, config=config(tmp_path, "ids"))
    train(engine, 2, inputs=torch.randint(0, 10, (4, 9)))  # (batch 4, seq 9) token ids
    samples = column(tmp_path / "ids" / "Train_Samples_samples_per_sec.csv")
    tokens = column(tmp_path / "ids" / "Train_Samples_tokens_per_sec.csv")
    assert tokens == pytest.approx([s * 9 for s in samples])


def test_bad_monitor_input_fails_initialize_with_one_clear_error(
        solo: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(DsrunConfigError, match=r"csv_monitor.output_path .* cannot create"):
        dsrun.initialize(model=model(), config=config(blocker))
    with pytest.raises(DsrunConfigError, match='unknown key "output_dir" in "csv_monitor"'):
        dsrun.initialize(model=model(), config={**config(tmp_path),
                                                "csv_monitor": {"output_dir": "x"}})
    monkeypatch.setitem(sys.modules, "tensorboard", None)
    with pytest.raises(DsrunConfigError, match="the tensorboard package is not installed"):
        dsrun.initialize(model=model(), config=config(tmp_path, "tb",
                                                      tensorboard={"enabled": True}))
    assert not (tmp_path / "tb").exists()
    engine, *_ = dsrun.initialize(model=model(), config=config(tmp_path, "ok"))
    with pytest.raises(DsrunError, match="event 0 is"):
        engine.monitor.write_events([("name", "not a number", 1)])


def test_without_monitors_nothing_is_written(solo: None, tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch,
                                             caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.chdir(tmp_path)
    cfg = {"train_micro_batch_size_per_gpu": 4, "steps_per_print": 2, "wall_clock_breakdown": True,
           "optimizer": {"type": "SGD", "params": {"lr": 1e-2}}}
    engine, *_ = dsrun.initialize(model=model(), config=cfg)
    assert not engine.monitor.enabled
    with caplog.at_level(logging.INFO, logger="dsrun.runtime.monitor"):
        train(engine, 4)
        engine.monitor.write_events([("Custom/x", 1.0, 1)])
    assert list(tmp_path.iterdir()) == []
    lines = [r.getMessage() for r in caplog.records if "time (ms per" in r.getMessage()]
    assert len(lines) == 2 and "mean of 2" in lines[0]


def test_wandb_in_offline_mode(solo: None, tmp_path: Path,
                               monkeypatch: pytest.MonkeyPatch) -> None:
    if importlib.util.find_spec("wandb") is None:
        pytest.skip("the wandb package is not installed")
    import wandb

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = config(tmp_path, wandb={"enabled": True, "project": "dsrun-test", "group": "g"})
    engine, *_ = dsrun.initialize(model=model(), config=cfg)
    losses = train(engine, 3)
    run = wandb.run
    assert run is not None and run.project == "dsrun-test" and run.group == "g"
    # wandb commits a step once a later one arrives (or at finish): the summary
    # holds the last committed step's values
    step = run.summary["_step"]
    assert step in (8, 12) and engine.global_samples == 12
    assert run.summary["Train/Samples/train_loss"] == pytest.approx(losses[step // 4 - 1],
                                                                   rel=1e-12)
    engine.monitor.close()
    assert wandb.run is None
    assert glob.glob(str(tmp_path / "wandb" / "offline-run-*" / "run-*.wandb"))


class FakeExperiment:
    """What CometWriter calls on a comet_ml experiment, recorded."""

    def __init__(self, **options: Any) -> None:
        self.options, self.name, self.metrics, self.ended = options, None, [], False

    def set_name(self, name: str) -> None:
        self.name = name

    def log_metric(self, name: str, value: float, step: int) -> None:
        self.metrics.append((name, value, step))

    def end(self) -> None:
        self.ended = True


def test_comet_experiment_gets_the_events_at_its_interval(
        solo: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """The ``comet`` section through the engine, with a stand-in comet_ml
    module (the package is not installed here): options passed to
    ``comet_ml.start``, the name set, the events logged at DeepSpeed's
    interval (each name's first, then every ``samples_log_interval``
    samples or more), the experiment ended on close, and the api_key kept out of
    the logs."""
    import types

    started: list[FakeExperiment] = []
    fake = types.ModuleType("comet_ml")
    fake.start = lambda **options: started.append(FakeExperiment(**options)) or started[-1]
    fake.__spec__ = importlib.machinery.ModuleSpec("comet_ml", None)
    monkeypatch.setitem(sys.modules, "comet_ml", fake)
    cfg = config(tmp_path, dump_state=True, comet={
        "enabled": True, "project": "p", "workspace": "w", "api_key": "SECRET-KEY",
        "experiment_name": "trial", "samples_log_interval": 8, "online": False})
    with caplog.at_level(logging.INFO):
        engine, *_ = dsrun.initialize(model=model(), config=cfg)
        losses = train(engine, 4)  # global_samples 4, 8, 12, 16
    (experiment,) = started
    assert experiment.options == {"api_key": "SECRET-KEY", "project": "p", "workspace": "w",
                                  "online": False}
    assert experiment.name == "trial"
    loss_events = [(v, s) for n, v, s in experiment.metrics if n == "Train/Samples/train_loss"]
    # DeepSpeed's EventsLogScheduler: a name's first event, then the first one
    # at least samples_log_interval samples after the last logged
    assert loss_events == [(pytest.approx(losses[0], rel=1e-12), 4),
                           (pytest.approx(losses[2], rel=1e-12), 12)]
    by_name: dict[str, list[int]] = {}
    for name, _, step in experiment.metrics:
        by_name.setdefault(name, []).append(step)
    assert all(b - a >= 8 for steps in by_name.values() for a, b in zip(steps, steps[1:]))
    assert "SECRET-KEY" not in caplog.text and '"api_key": "<redacted>"' in caplog.text
    engine.monitor.close()
    assert experiment.ended


def test_comet_section_errors(solo: None, tmp_path: Path,
                              monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(DsrunConfigError, match="comet.mode"):
        dsrun.initialize(model=model(), config=config(tmp_path, comet={"mode": "sometimes"}))
    monkeypatch.setitem(sys.modules, "comet_ml", None)
    with pytest.raises(DsrunConfigError, match="pip install comet_ml"):
        dsrun.initialize(model=model(), config=config(tmp_path, comet={"enabled": True}))


def test_comet_offline_with_the_real_package(solo: None, tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """Where comet_ml is installed: an offline experiment's archive holds
    the engine's losses at DeepSpeed's interval (the first, then 8 samples on)."""
    if importlib.util.find_spec("comet_ml") is None:
        pytest.skip("the comet_ml package is not installed")
    import json
    import zipfile

    monkeypatch.setenv("COMET_OFFLINE_DIRECTORY", str(tmp_path / "comet"))
    cfg = config(tmp_path, comet={"enabled": True, "project": "dsrun-test", "online": False,
                                  "samples_log_interval": 8})
    engine, *_ = dsrun.initialize(model=model(), config=cfg)
    losses = train(engine, 4)
    engine.monitor.close()
    (archive,) = glob.glob(str(tmp_path / "comet" / "*.zip"))
    with zipfile.ZipFile(archive) as z:
        messages = [json.loads(line) for line in z.read("messages.json").decode().splitlines()]
    logged = {m["payload"]["metric"]["step"]: m["payload"]["metric"]["metricValue"]
              for m in messages if m.get("type") == "metric_msg"
              and m["payload"]["metric"]["metricName"] == "Train/Samples/train_loss"}
    assert logged == {4: pytest.approx(losses[0], rel=1e-12),
                      12: pytest.approx(losses[2], rel=1e-12)}
