"""Monitors without processes: config sections, CSV layout, fan-out, failures, timers."""

from __future__ import annotations

import csv
import json
import logging
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from dsrun.errors import DsrunConfigError, DsrunError
from dsrun.runtime.config import DsrunConfig, resolve
from dsrun.runtime.monitor import events as ev
from dsrun.runtime.monitor.master import Monitor, check_events
from dsrun.runtime.monitor.timers import CommWaits, StepTimers, format_breakdown
from dsrun.runtime.monitor.writers import CsvWriter, build_writers


def res(config: dict[str, Any], **kwargs: Any) -> DsrunConfig:
    kwargs.setdefault("environ", {})
    return resolve({"train_batch_size": 8, **config}, dp_size=2, dp_source="test", **kwargs)


def read_csv(path: Path) -> list[list[str]]:
    with open(path, newline="") as handle:
        return list(csv.reader(handle))


# ----------------------------------------------------------------- config


def test_monitor_sections_have_deepspeeds_keys_and_defaults() -> None:
    config = res({})
    assert (config.csv_monitor.enabled, config.csv_monitor.output_path,
            config.csv_monitor.job_name) == (False, "", "DeepSpeedJobName")
    assert config.tensorboard.job_name == "DeepSpeedJobName"
    assert (config.wandb.project, config.wandb.group, config.wandb.team) == ("deepspeed", None,
                                                                             None)
    config = res({"csv_monitor": {"enabled": True, "output_path": "runs", "job_name": "a"},
                  "wandb": {"enabled": True, "group": "g", "team": "t", "project": "p"},
                  "dsrun": {"seq_length": 128}})
    assert config.csv_monitor.output_path == "runs" and config.wandb.team == "t"
    assert config.dsrun.seq_length == 128
    assert "csv_monitor" not in config.passthrough
    assert "monitors: csv_monitor, wandb" in config.summary()
    assert res(config.to_dict()) == config


def test_comet_section_defaults_and_summary() -> None:
    config = res({})
    assert (config.comet.enabled, config.comet.samples_log_interval, config.comet.mode) == \
        (False, 100, None)
    config = res({"comet": {"enabled": True, "project": "p", "api_key": "SECRET-KEY-42",
                            "online": False}})
    assert "monitors: comet" in config.summary() and "comet" not in config.passthrough
    assert config.comet.api_key == "SECRET-KEY-42" and "SECRET-KEY-42" not in config.summary()
    with pytest.raises(DsrunConfigError, match="samples_log_interval"):
        res({"comet": {"samples_log_interval": 0}})


def test_redact_secrets() -> None:
    from dsrun.runtime.initialize import redact_secrets

    raw = {"comet": {"api_key": "k", "project": "p", "nested": [{"hf_token": "t"}]},
           "api_key": None, "secret_count": 3}
    assert redact_secrets(raw) == {
        "comet": {"api_key": "<redacted>", "project": "p",
                  "nested": [{"hf_token": "<redacted>"}]},
        "api_key": None, "secret_count": 3}


@pytest.mark.parametrize(("section", "raw", "wrong", "right"), [
    ("csv_monitor", {"enable": True}, "enable", "enabled"),
    ("tensorboard", {"enabled": True, "output_dir": "x"}, "output_dir", "output_path"),
    ("wandb", {"projet": "p"}, "projet", "project"),
    ("csv_monitor", {"jobname": "j"}, "jobname", "job_name"),
])
def test_unknown_monitor_keys_are_errors_with_did_you_mean(section: str, raw: dict[str, Any],
                                                           wrong: str, right: str) -> None:
    with pytest.raises(DsrunConfigError) as err:
        res({section: raw})
    text = str(err.value)
    assert f'unknown key "{wrong}" in "{section}"' in text
    assert f'did you mean "{right}"?' in text


def test_misspelt_monitor_section_and_bad_values() -> None:
    with pytest.raises(DsrunConfigError, match='did you mean "csv_monitor"'):
        res({"csv_monitr": {"enabled": True}})
    with pytest.raises(DsrunConfigError, match='"wandb.enabled" in config dict must be true or'):
        res({"wandb": {"enabled": "yes"}})
    with pytest.raises(DsrunConfigError, match='"tensorboard.output_path" .* must be a string'):
        res({"tensorboard": {"output_path": 3}})
    with pytest.raises(DsrunConfigError, match='"dsrun.seq_length" .* >= 1'):
        res({"dsrun": {"seq_length": 0}})


def test_unknown_monitor_keys_only_warn_when_allowed(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="dsrun.runtime.config"):
        config = res({"csv_monitor": {"enabled": True, "flush_every": 3}},
                     environ={"DSRUN_ALLOW_UNKNOWN_CONFIG_KEYS": "1"})
    assert config.ignored_keys == ("csv_monitor.flush_every",) and config.csv_monitor.enabled
    assert "flush_every" in caplog.text


# ----------------------------------------------------------------- events


def test_event_names_and_csv_layout_follow_deepspeed() -> None:
    assert ev.TRAIN_LOSS == "Train/Samples/train_loss"
    assert ev.csv_filename(ev.TRAIN_LOSS) == "Train_Samples_train_loss.csv"
    assert ev.csv_header(ev.TRAIN_LOSS) == "train_loss"
    assert ev.csv_filename("My metric/a b") == "My_metric_a_b.csv"
    assert ev.csv_header("plain") == "plain"
    assert [ev.lr_event(i) for i in range(3)] == [
        "Train/Samples/lr", "Train/Samples/lr_group1", "Train/Samples/lr_group2"]
    assert ev.time_event("backward_allreduce") == \
        "Train/Samples/elapsed_time_ms_backward_allreduce"
    with pytest.raises(ValueError, match="unknown breakdown part"):
        ev.time_event("lunch")


def test_csv_writer_rows_header_once_and_run_info(tmp_path: Path) -> None:
    writer = CsvWriter(str(tmp_path), {"train_batch_size": 8})
    writer.write([(ev.TRAIN_LOSS, 0.5, 8), (ev.LR, 0.1, 8)])
    writer.write([(ev.TRAIN_LOSS, 0.25, 16)])
    assert read_csv(tmp_path / "Train_Samples_train_loss.csv") == [
        ["step", "train_loss"], ["8", "0.5"], ["16", "0.25"]]  # flushed: readable at once
    writer.close()
    # a second run appending to the same directory does not repeat the header
    again = CsvWriter(str(tmp_path))
    again.write([(ev.TRAIN_LOSS, 0.125, 24)])
    again.close()
    assert read_csv(tmp_path / "Train_Samples_train_loss.csv")[-2:] == [["16", "0.25"],
                                                                        ["24", "0.125"]]
    assert json.loads((tmp_path / ev.RUN_INFO).read_text()) == {"train_batch_size": 8}


def test_check_events_accepts_numbers_and_one_element_tensors() -> None:
    class OneElement:  # duck-types a 0-d tensor without importing torch
        def numel(self) -> int:
            return 1

        def item(self) -> float:
            return 2.5

    class IntElement(OneElement):  # a 0-d integer tensor as the step
        def item(self) -> int:  # type: ignore[override]
            return 7

    assert check_events([("a", 1, 3), ["b", OneElement(), 4]]) == [("a", 1.0, 3), ("b", 2.5, 4)]
    # bools are 0 and 1 (TensorBoard takes them), a one-element integer tensor is a step
    assert check_events([("a", True, IntElement())]) == [("a", 1.0, 7)]
    # a whole float step (computed in floats) is taken, as DeepSpeed's writers take it
    assert check_events([("x", 2.0, 5.0)]) == [("x", 2.0, 5)]

    class WholeFloatElement(OneElement):  # torch.tensor(5.0) as the step
        def item(self) -> float:
            return 5.0

    assert check_events([("x", 2.0, WholeFloatElement())]) == [("x", 2.0, 5)]
    for bad in [("a", 1.0), ("", 1.0, 1), ("a", "x", 1), ("a", 1.0, 1.5), ("a", 1.0, True),
                ("a", 1.0, float("nan")), ("a", 1.0, float("inf")),
                ("a", 1.0, OneElement()), "a,1,1"]:
        with pytest.raises(DsrunError, match="event 1 is"):
            check_events([("ok", 0.0, 0), bad])


# ------------------------------------------------------------ fan-out, failures


class FakeWriter:
    def __init__(self, name: str, fail_on: int = 0) -> None:
        self.name = name
        self.fail_on = fail_on
        self.seen: list[Any] = []
        self.closed = False

    def write(self, events: Sequence[Any]) -> None:
        if self.fail_on and len(self.seen) + 1 == self.fail_on:
            raise OSError(28, "No space left on device")
        self.seen.append(list(events))

    def close(self) -> None:
        self.closed = True


def enabled_config(tmp_path: Path) -> DsrunConfig:
    return res({"csv_monitor": {"enabled": True, "output_path": str(tmp_path)}})


def test_only_rank_0_builds_writers_and_disabled_writes_nothing(tmp_path: Path) -> None:
    built: list[int] = []

    def build(config: Any) -> list[Any]:
        built.append(1)
        return [FakeWriter("fake")]

    other = Monitor(enabled_config(tmp_path), rank=1, build=build)
    assert other.enabled and not other.writers and not built
    other.write_events([("x", 1.0, 1)])  # nothing to write off rank 0
    with pytest.raises(DsrunError, match="event 0"):  # but the same error as rank 0's
        other.write_events([("bad event",)])
    off = Monitor(res({}), rank=0, build=build)
    off.write_events([("bad event",)])  # no monitor: ignored, as in DeepSpeed
    assert not off.enabled and not built
    on = Monitor(enabled_config(tmp_path), rank=0, build=build)
    on.write_events([("x", 1.0, 1)])
    assert built == [1] and on.writers[0].seen == [[("x", 1.0, 1)]]
    with pytest.raises(DsrunError, match="event 0"):
        on.write_events([("x", None, 1)])


def test_a_failing_writer_warns_once_and_the_others_go_on(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    failing, healthy = FakeWriter("tensorboard", fail_on=2), FakeWriter("csv_monitor")
    monitor = Monitor(enabled_config(tmp_path), rank=0, build=lambda c: [failing, healthy])
    with caplog.at_level(logging.WARNING, logger="dsrun.runtime.monitor"):
        for step in range(5):
            monitor.write_events([("loss", 1.0 / (step + 1), step)])
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "tensorboard: writing metrics failed (OSError" in warnings[0].getMessage()
    assert "training goes on" in warnings[0].getMessage()
    assert failing.closed and len(failing.seen) == 1 and len(healthy.seen) == 5
    monitor.close()
    assert healthy.closed and not monitor.writers


# ---------------------------------------------------- missing packages, paths


@pytest.mark.parametrize(("section", "package"), [
    ("tensorboard", "tensorboard"), ("wandb", "wandb"), ("comet", "comet_ml")])
def test_enabled_but_missing_package_is_one_clear_error_on_every_rank(
        section: str, package: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setitem(sys.modules, package, None)  # hides it, installed or not
    config = res({section: {"enabled": True},
                  "csv_monitor": {"enabled": True, "output_path": str(tmp_path / "csv")}})
    for rank in (0, 1):
        with pytest.raises(DsrunConfigError) as err:
            Monitor(config, rank=rank)
        text = str(err.value)
        assert f'"{section}" is enabled in config dict but the {package} package is not ' \
               "installed" in text
        assert f"pip install {package}" in text and f'"{section}": {{"enabled": false}}' in text
    assert not (tmp_path / "csv").exists()  # nothing was started or created


def test_output_path_that_cannot_be_created(tmp_path: Path) -> None:
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    config = res({"csv_monitor": {"enabled": True, "output_path": str(blocker / "runs"),
                                  "job_name": "j"}})
    with pytest.raises(DsrunConfigError) as err:
        build_writers(config)
    text = str(err.value)
    assert f"csv_monitor.output_path '{blocker / 'runs'}' with job_name 'j' (in config dict)" \
        in text
    assert "cannot create the directory" in text and "Not a directory" in text


def test_csv_monitor_default_output_path_is_the_working_directory(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    writers = build_writers(res({"csv_monitor": {"enabled": True}}))
    assert [w.name for w in writers] == ["csv_monitor"]
    writers[0].write([(ev.LR, 0.1, 8)])
    writers[0].close()
    assert (tmp_path / "DeepSpeedJobName" / "Train_Samples_lr.csv").exists()
    info = json.loads((tmp_path / "DeepSpeedJobName" / ev.RUN_INFO).read_text())
    assert info["train_batch_size"] == 8 and info["step_unit"] == "global_samples"


# ------------------------------------------------------------------- timers


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_step_timers_attribute_time_to_phases_and_communication() -> None:
    clock = FakeClock()
    comm = CommWaits(clock)
    timers = StepTimers(True, comm=comm, clock=clock)
    assert comm.enabled
    for _ in range(2):  # two optimizer steps of two micro-steps each
        for _ in range(2):
            with timers.phase("forward"):
                clock.now += 0.010
                with comm.timed("gather"):
                    clock.now += 0.001
            with timers.phase("backward"):
                clock.now += 0.020
                with comm.timed("reduce"):
                    with comm.timed("reduce"):  # nested: counted once
                        clock.now += 0.005
        with timers.phase("step"):
            clock.now += 0.003
            timers.add("monitor", 0.001)
        timers.end_step(iteration_s=0.1)
    assert timers.steps_pending == 2
    means = timers.take_means()
    assert means["forward"] == pytest.approx(22.0)  # ms per optimizer step
    assert means["backward"] == pytest.approx(50.0)
    assert means["backward_allreduce"] == pytest.approx(10.0)
    assert means["backward_inner"] == pytest.approx(40.0)
    assert means["comm_reduce"] == pytest.approx(10.0)
    assert means["comm_gather"] == pytest.approx(2.0)
    assert means["step"] == pytest.approx(3.0) and means["monitor"] == pytest.approx(1.0)
    assert means["iteration"] == pytest.approx(100.0)
    assert timers.take_means() == {}  # reset
    line = format_breakdown(means, 2)
    assert line.startswith("time (ms per optimizer step, mean of 2): forward 22.00 | "
                           "backward 50.00 (communication wait 10.00) | step 3.00 (monitor 1.00)")


def test_disabled_timers_and_waits_cost_nothing_and_record_nothing() -> None:
    clock = FakeClock()
    comm = CommWaits(clock)
    timers = StepTimers(False, comm=comm, clock=clock)
    assert not comm.enabled
    with timers.phase("forward"):
        clock.now += 1.0
    timers.end_step(1.0)
    assert timers.take_means() == {}
    with pytest.raises(ValueError, match="unknown communication kind"):
        with comm.timed("broadcast"):
            pass
    with pytest.raises(ValueError, match="unknown phase"):
        StepTimers(True, comm=CommWaits(clock), clock=clock).phase("lunch")
