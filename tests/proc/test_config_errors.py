"""A config mistake is one clear message: in the launcher for --config (exit 2,
nothing started), and once per job - without dsrun's frames - when a script
hands dsrun.initialize a bad config itself."""

from __future__ import annotations

import json

from tests.conftest import WORKERS, run_dsrun


def test_bad_config_file_stops_the_launch_with_file_line_and_suggestion(tmp_path):
    cfg = tmp_path / "ds.json"
    cfg.write_text(json.dumps({"train_batch_size": 8,
                               "zero_optimization": {"stgae": 1}}, indent=2))
    marker = tmp_path / "started"
    script = tmp_path / "train.py"
    script.write_text(f"open({str(marker)!r}, 'w').close()\n")
    res = run_dsrun("--cpu", "--num_gpus", "2", "--config", str(cfg), str(script))
    assert res.returncode == 2
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1, res.stderr
    assert lines[0].startswith(f"dsrun: error: --config {cfg}:4: unknown key \"stgae\"")
    assert 'did you mean "stage"?' in lines[0]
    assert not marker.exists() and res.stdout == ""


def test_indivisible_batch_size_is_found_before_the_ranks_start(tmp_path):
    cfg = tmp_path / "ds.json"
    cfg.write_text('{"train_batch_size": 9, "train_micro_batch_size_per_gpu": 2}\n')
    res = run_dsrun("--cpu", "--num_gpus", "2", "--config", str(cfg), "--dry-run",
                    str(WORKERS / "hang.py"))
    assert res.returncode == 2
    assert res.stderr.startswith(f"dsrun: error: --config {cfg}:1: ")
    assert "data-parallel size 2" in res.stderr and res.stdout == ""


def test_batch_size_only_a_pipeline_could_use_is_a_warning_before_the_ranks_start(tmp_path):
    cfg = tmp_path / "ds.json"
    cfg.write_text('{\n  "train_batch_size": 3\n}\n')  # 3 samples do not split over 2 ranks
    res = run_dsrun("--cpu", "--num_gpus", "2", "--config", str(cfg), "--dry-run",
                    str(WORKERS / "hang.py"))
    assert res.returncode == 0, res.stderr
    assert f"dsrun: warning: --config {cfg}:2: " in res.stderr
    assert "it fits 1 data-parallel rank(s)" in res.stderr


def test_config_error_inside_the_ranks_is_one_message_without_dsrun_frames():
    res = run_dsrun("--cpu", "--num_gpus", "2", str(WORKERS / "bad_config.py"), timeout=120)
    assert res.returncode == 1, res.stderr
    output = res.stdout + res.stderr
    assert output.count('unknown key "zero_optimzation"') == 1, output
    assert "did you mean \"zero_optimization\"" in output
    assert f"at {WORKERS / 'bad_config.py'}:14 in <module>" in output
    assert "dsrun/runtime" not in output and "Traceback" not in output
    # the other rank fails with the same error unless the teardown stops it
    # first (they are milliseconds apart): either way the error is printed once
    assert ("1 other rank(s) failed with the same error" in output
            or "1 other rank(s) stopped as a consequence" in output), output
    assert len(output.splitlines()) < 20, output
