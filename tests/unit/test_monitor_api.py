"""DeepSpeed's ``deepspeed.monitor`` module paths (:mod:`dsrun.monitor`):
the "Custom Monitoring" tutorial's stand-alone ``MonitorMaster``, the
backend classes, rank 0 writing alone."""

from __future__ import annotations

import sys
import types
from pathlib import Path
from typing import Any

import pytest
import torch

import dsrun  # noqa: F401 - installs the deepspeed alias
from dsrun.errors import DsrunConfigError, DsrunError


@pytest.fixture(autouse=True)
def rank_zero(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """No process group here: the rank comes from RANK (0 unless a test says)."""
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.chdir(tmp_path)


def csv_config(tmp_path: Path) -> dict[str, Any]:
    return {"train_batch_size": 8,  # other keys are not the monitor's business
            "csv_monitor": {"enabled": True, "output_path": str(tmp_path / "out"),
                            "job_name": "job"}}


def test_the_tutorials_stand_alone_monitor_writes_deepspeeds_csv(tmp_path: Path) -> None:
    from deepspeed.monitor.config import get_monitor_config
    from deepspeed.monitor.csv_monitor import csvMonitor
    from deepspeed.monitor.monitor import Monitor, MonitorMaster

    monitor = MonitorMaster(get_monitor_config(csv_config(tmp_path)))
    assert monitor.enabled and isinstance(monitor, Monitor)
    assert isinstance(monitor.csv_monitor, csvMonitor) and monitor.tb_monitor is None
    monitor.write_events([("Train/Samples/custom", 1.5, 8), ("Train/Samples/custom", 2.0, 16)])
    monitor.close()
    job = tmp_path / "out" / "job"
    assert monitor.csv_monitor.log_dir == str(job)
    assert (job / "Train_Samples_custom.csv").read_text().splitlines() == [
        "step,custom", "8,1.5", "16,2.0"]
    assert not (job / "dsrun_run.json").exists()  # steps are the script's: plotted as given
    with pytest.raises(DsrunError, match="event 0"):
        monitor.write_events([("no step", 1.0)])


def test_only_rank_0_writes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from dsrun.monitor.config import get_monitor_config
    from dsrun.monitor.csv_monitor import csvMonitor
    from dsrun.monitor.monitor import MonitorMaster

    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    config = get_monitor_config(csv_config(tmp_path))
    monitor = MonitorMaster(config)
    assert monitor.enabled and monitor.csv_monitor is None  # DeepSpeed's: nothing built
    monitor.write_events([("Train/x", 1.0, 1)])
    backend = csvMonitor(config.csv_monitor)
    backend.write_events([("Train/x", 1.0, 1)])
    assert backend.log_dir is None and not (tmp_path / "out").exists()


def test_config_classes_take_deepspeeds_keywords_and_are_strict(tmp_path: Path) -> None:
    from deepspeed.monitor.config import (
        CometConfig,
        CSVConfig,
        DeepSpeedMonitorConfig,
        TensorBoardConfig,
        WandbConfig,
    )

    csv = CSVConfig(enabled=True, output_path=str(tmp_path), job_name="j")
    config = DeepSpeedMonitorConfig(csv_monitor=csv, wandb={"project": "p"})
    assert config.csv_monitor is csv and config.wandb.project == "p" and config.enabled
    assert isinstance(config.tensorboard, TensorBoardConfig)
    assert isinstance(config.wandb, WandbConfig) and isinstance(config.comet, CometConfig)
    assert config.comet.samples_log_interval == 100 and config.tensorboard.job_name == \
        "DeepSpeedJobName"
    assert not DeepSpeedMonitorConfig().enabled
    with pytest.raises(DsrunConfigError, match='"output_pth".*did you mean'):
        DeepSpeedMonitorConfig(csv_monitor={"output_pth": "x"})


def test_disabled_monitor_writes_nothing(tmp_path: Path) -> None:
    from dsrun.monitor.monitor import MonitorMaster

    monitor = MonitorMaster({"csv_monitor": {"enabled": False}})  # a config dict works too
    assert not monitor.enabled
    monitor.write_events([("anything", 1.0, 1)])
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(TypeError, match="DeepSpeedMonitorConfig"):
        MonitorMaster(42)


def test_tensorboard_backend(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    from dsrun.monitor.config import TensorBoardConfig
    from dsrun.monitor.tensorboard import TensorBoardMonitor

    tb = TensorBoardMonitor(TensorBoardConfig(enabled=True, output_path=str(tmp_path),
                                              job_name="tb"))
    assert tb.summary_writer is not None and tb.summary_writer.log_dir == str(tmp_path / "tb")
    tb.write_events([("Train/x", 1.0, 1)], flush=False)
    tb.flush()
    tb.close()
    assert any(p.name.startswith("events.out.tfevents") for p in (tmp_path / "tb").iterdir())


def test_wandb_backend_through_a_stand_in(monkeypatch: pytest.MonkeyPatch) -> None:
    logged: list[tuple[dict[str, Any], Any, Any]] = []
    started: list[dict[str, Any]] = []

    class Run:
        def log(self, data: dict[str, Any], step: Any = None, commit: Any = None) -> None:
            logged.append((data, step, commit))

        def finish(self) -> None:
            pass

    def init(**kwargs: Any) -> Run:
        started.append(kwargs)
        return Run()

    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(init=init))
    from dsrun.monitor.config import WandbConfig
    from dsrun.monitor.wandb import WandbMonitor

    wb = WandbMonitor(WandbConfig(enabled=True, project="p", team="t"))
    assert started == [{"project": "p", "group": None, "entity": "t"}]
    wb.write_events([("a", 1.0, 5), ("b", 2.0, 5)])
    wb.log({"c": 3.0}, step=6, commit=True)
    assert logged == [({"a": 1.0, "b": 2.0}, 5, None), ({"c": 3.0}, 6, True)]


def test_missing_package_is_an_error_on_every_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    from dsrun.monitor.comet import CometMonitor
    from dsrun.monitor.config import CometConfig

    monkeypatch.setitem(sys.modules, "comet_ml", None)
    for rank in ("0", "1"):
        monkeypatch.setenv("RANK", rank)
        monkeypatch.setenv("WORLD_SIZE", "2")
        with pytest.raises(DsrunConfigError, match="pip install comet_ml"):
            CometMonitor(CometConfig(enabled=True))


def test_availability_checks_print_the_hint_and_raise(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    from deepspeed.monitor.utils import (
        check_comet_availability,
        check_tb_availability,
        check_wandb_availability,
    )

    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb raises ImportError
    with pytest.raises(ImportError):
        check_wandb_availability()
    assert "`pip install wandb`" in capsys.readouterr().out
    monkeypatch.setitem(sys.modules, "wandb", types.ModuleType("wandb"))
    check_wandb_availability()
    monkeypatch.setitem(sys.modules, "tensorboard", None)
    with pytest.raises(ImportError):
        check_tb_availability()
    assert "`pip install tensorboard`" in capsys.readouterr().out
    for version, ok in (("3.40.9", False), ("3.41.0", True), ("3.41.2rc1", True), ("10.0", True),
                        ("", False)):
        comet = types.ModuleType("comet_ml")
        comet.__version__ = version  # type: ignore[attr-defined]
        monkeypatch.setitem(sys.modules, "comet_ml", comet)
        if ok:
            check_comet_availability()
        else:
            with pytest.raises(ImportError, match="at least version 3.41.0"):
                check_comet_availability()
            assert '`pip install "comet_ml>=3.41.0"`' in capsys.readouterr().out


def test_an_engines_monitor_is_a_monitor_master(tmp_path: Path) -> None:
    from deepspeed.monitor.monitor import Monitor, MonitorMaster

    from dsrun.runtime.config import resolve
    from dsrun.runtime.monitor.training import EngineMonitor
    from dsrun.runtime.pipe.metrics import PipelineMonitor

    assert issubclass(EngineMonitor, MonitorMaster) and issubclass(PipelineMonitor, EngineMonitor)
    config = resolve(csv_config(tmp_path), dp_size=1, dp_source="test", environ={})
    monitor = EngineMonitor(config, rank=0, group=None, device=torch.device("cpu"))
    assert isinstance(monitor, MonitorMaster) and isinstance(monitor, Monitor)
    # DeepSpeed's monitor_config: the four sections of the engine's config
    assert monitor.monitor_config.csv_monitor is config.csv_monitor
    assert monitor.enabled and monitor.monitor_config.enabled and monitor.tb_monitor is None
    monitor.write_events([("Train/Samples/custom", 1.5, 8)])
    monitor.close()
    job = tmp_path / "out" / "job"
    assert (job / "Train_Samples_custom.csv").read_text().splitlines() == ["step,custom", "8,1.5"]
    assert (job / "dsrun_run.json").exists()  # the engine's writers: described for dsrun plot
    quiet = EngineMonitor(resolve({"train_batch_size": 8}, dp_size=1, dp_source="test",
                                  environ={}), rank=0, group=None, device=torch.device("cpu"))
    assert isinstance(quiet, MonitorMaster) and not quiet.enabled
    assert not quiet.monitor_config.enabled and quiet.csv_monitor is None
