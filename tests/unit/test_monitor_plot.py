"""``dsrun plot`` and reading run directories back, on CSV files written here."""

from __future__ import annotations

import struct
import subprocess
import sys
from pathlib import Path

import pytest

from dsrun.errors import DsrunError, DsrunUsageError
from dsrun.launcher import cli
from dsrun.runtime.monitor import events as ev
from dsrun.runtime.monitor.plot import plot_runs, smooth
from dsrun.runtime.monitor.runs import find_runs, read_run
from dsrun.runtime.monitor.writers import CsvWriter

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def png_size(path: Path) -> tuple[int, int]:
    """(width, height) from a PNG's IHDR chunk, after checking the signature."""
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE, data[:8]
    assert data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def fake_run(directory: Path, steps: int = 30, batch: int = 8, *, fp16: bool = False,
             info: bool = True) -> Path:
    """A run directory as the engine writes it (CsvWriter, DeepSpeed's names)."""
    directory.mkdir(parents=True)
    writer = CsvWriter(str(directory), {"train_batch_size": batch} if info else None)
    for step in range(1, steps + 1):
        samples = step * batch
        events = [(ev.TRAIN_LOSS, 2.0 / step, samples), (ev.LR, 1e-3 * min(step, 5) / 5, samples),
                  (ev.lr_event(1), 5e-4, samples), (ev.GRAD_NORM, 1.0 + 1.0 / step, samples),
                  (ev.SAMPLES_PER_SEC, 900.0 + step, samples),
                  (ev.TOKENS_PER_SEC, 128 * (900.0 + step), samples)]
        if fp16:
            events.append((ev.LOSS_SCALE, 2.0 ** (16 - step // 10), samples))
        if step % 10 == 0:
            events += [(ev.time_event(p), v, samples) for p, v in (
                ("forward", 3.0), ("backward", 6.0), ("backward_inner", 4.0),
                ("backward_allreduce", 2.0), ("step", 1.0), ("iteration", 11.0))]
        writer.write(events)
    writer.close()
    return directory


def test_read_run_turns_samples_into_steps_and_keeps_the_last_row_per_step(
        tmp_path: Path) -> None:
    run_dir = fake_run(tmp_path / "job", steps=3)
    with open(run_dir / "Train_Samples_train_loss.csv", "a") as handle:
        # a resumed DeepSpeed run: its header again, then steps 2.. rewritten; a cut line
        handle.write("step,train_loss\n16,0.9\n24,0.8\n32,0.7\n40,nan\n48\n")
    run = read_run(str(run_dir))
    loss = run.get(ev.TRAIN_LOSS)
    assert run.x_label == "optimizer step" and run.label == "job"
    assert loss is not None and loss.header == "train_loss"
    assert loss.x == (1.0, 2.0, 3.0, 4.0) and loss.values == (2.0, 0.9, 0.8, 0.7)
    assert run.get(ev.lr_event(1)) is not None and run.get(ev.LOSS_SCALE) is None


def test_a_directory_deepspeed_wrote_is_read_in_samples(tmp_path: Path) -> None:
    run = read_run(str(fake_run(tmp_path / "ds", steps=2, info=False)))
    assert run.x_label == "samples" and run.get(ev.TRAIN_LOSS).x == (8.0, 16.0)


def test_find_runs_descends_one_level_and_names_runs_uniquely(tmp_path: Path) -> None:
    fake_run(tmp_path / "out" / "a", steps=2)
    fake_run(tmp_path / "out" / "b", steps=2)
    (tmp_path / "out" / "tb").mkdir()  # tensorboard files only: not a CSV run
    fake_run(tmp_path / "other" / "a", steps=2)
    runs = find_runs([str(tmp_path / "out"), str(tmp_path / "other" / "a")])
    assert [r.label for r in runs] == ["out/a", "b", "other/a"]


def test_labels_are_the_shortest_distinguishing_path_suffix(tmp_path: Path) -> None:
    """``exp1/csv/job`` and ``exp2/csv/job`` (only output_path changed) were
    both labelled ``csv/job``."""
    runs = find_runs([str(fake_run(tmp_path / "exp1" / "csv" / "job", steps=2)),
                      str(fake_run(tmp_path / "exp2" / "csv" / "job", steps=2)),
                      str(fake_run(tmp_path / "solo", steps=2))])
    assert [r.label for r in runs] == ["exp1/csv/job", "exp2/csv/job", "solo"]
    same = str(tmp_path / "solo")
    assert len({r.label for r in find_runs([same, same])}) == 1  # one run given twice


def test_runs_in_steps_and_in_samples_share_the_samples_axis(tmp_path: Path) -> None:
    from dsrun.runtime.monitor.runs import common_x

    dsrun_run = read_run(str(fake_run(tmp_path / "dsrun", steps=3, batch=8)))
    deepspeed_run = read_run(str(fake_run(tmp_path / "ds", steps=3, batch=8, info=False)))
    assert common_x([dsrun_run]) == [dsrun_run]  # one unit: left alone
    both = common_x([dsrun_run, deepspeed_run])
    assert [r.x_label for r in both] == ["samples", "samples"]
    assert both[0].get(ev.TRAIN_LOSS).x == both[1].get(ev.TRAIN_LOSS).x == (8.0, 16.0, 24.0)
    assert both[0].get(ev.TRAIN_LOSS).values == dsrun_run.get(ev.TRAIN_LOSS).values


def test_no_metrics_and_missing_directories_are_clear_errors(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    with pytest.raises(DsrunUsageError) as err:
        find_runs([str(tmp_path / "empty")])
    assert "no metrics in" in str(err.value) and "csv_monitor" in str(err.value)
    assert "Train_Samples_train_loss.csv" in str(err.value)
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "notes.csv").write_text("a,b\nx,y\n")  # no numeric rows
    with pytest.raises(DsrunUsageError, match="no metrics in"):
        find_runs([str(tmp_path / "junk")])
    with pytest.raises(DsrunUsageError, match="does not exist or is not a directory"):
        find_runs([str(tmp_path / "nowhere")])


def test_smoothing_is_tensorboards_debiased_ema() -> None:
    assert smooth([5.0, 5.0, 5.0], 0.9) == pytest.approx([5.0, 5.0, 5.0])
    assert smooth([1.0, 3.0], 0.0) == [1.0, 3.0]
    assert smooth([0.0, 1.0], 0.5) == pytest.approx([0.0, (0.5 * 0.0 * 0.5 + 0.5) / 0.75])
    with pytest.raises(DsrunUsageError, match=r"--smooth must be in \[0, 1\)"):
        smooth([1.0], 1.0)


def test_plot_writes_a_png_of_one_or_several_runs(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    one = fake_run(tmp_path / "fp32", steps=40)
    two = fake_run(tmp_path / "fp16", steps=40, fp16=True)
    out = tmp_path / "one.png"
    assert plot_runs(find_runs([str(one)]), str(out)) == 5  # no loss-scale panel in fp32
    width, height = png_size(out)
    assert (width, height) == (1280, 1080)
    assert 20_000 < out.stat().st_size < 1_000_000
    out = tmp_path / "both.png"
    assert plot_runs(find_runs([str(one), str(two)]), str(out)) == 6
    assert png_size(out)[0] == 1280


def test_plot_refuses_bad_outputs_and_unplottable_runs(tmp_path: Path) -> None:
    runs = find_runs([str(fake_run(tmp_path / "r", steps=3))])
    with pytest.raises(DsrunUsageError, match="end the name with .png"):
        plot_runs(runs, str(tmp_path / "r.svg"))
    custom = tmp_path / "custom"
    custom.mkdir()
    writer = CsvWriter(str(custom))
    writer.write([("Custom/thing", 1.0, 1)])
    writer.close()
    with pytest.raises(DsrunUsageError, match="none of the training metrics"):
        plot_runs(find_runs([str(custom)]), str(tmp_path / "c.png"))
    pytest.importorskip("matplotlib")
    with pytest.raises(DsrunUsageError, match="does not exist"):
        plot_runs(runs, str(tmp_path / "no" / "dir" / "r.png"))


def test_missing_matplotlib_is_one_clear_error(tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    runs = find_runs([str(fake_run(tmp_path / "r", steps=3))])
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    with pytest.raises(DsrunError) as err:
        plot_runs(runs, str(tmp_path / "r.png"))
    assert "dsrun plot needs matplotlib" in str(err.value)
    # dsrun is not on PyPI: the hint is what works, not pip install 'dsrun[plot]'
    assert "): pip install matplotlib (or, in a dsrun checkout, .venv/bin/pip install -e " \
           "'.[plot]')" in str(err.value)
    assert "dsrun[plot]" not in str(err.value)
    assert not (tmp_path / "r.png").exists()


def test_cli_plot_exit_codes_and_messages(tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "empty").mkdir()
    assert cli.main(["plot", str(tmp_path / "empty")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("dsrun: error: no metrics in") and err.count("\n") == 1
    assert cli.main(["plot"]) == 2
    assert "Missing argument 'RUN_DIR...'" in capsys.readouterr().err


def test_cli_plot_draws_a_png(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("matplotlib")
    run_dir = fake_run(tmp_path / "run", steps=12)
    out = tmp_path / "x.png"
    assert cli.main(["plot", str(run_dir), "-o", str(out), "--smooth", "0"]) == 0
    assert "dsrun plot: wrote" in capsys.readouterr().out
    assert png_size(out) == (1280, 1080)
    assert cli.main(["plot", str(run_dir), "--smooth", "1.5"]) == 2
    assert "--smooth must be in [0, 1)" in capsys.readouterr().err


def test_plot_command_does_not_import_torch(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    code = ("import sys; from dsrun.launcher import cli; "
            "import dsrun.runtime.monitor.plot, dsrun.runtime.monitor.runs; "
            f"rc = cli.main(['plot', {str(tmp_path / 'empty')!r}]); "
            "print('RC', rc, sorted(m for m in ('torch', 'matplotlib') if m in sys.modules))")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60)
    assert "RC 2 []" in res.stdout, res.stderr
