"""dsrun --config checked in the launcher: file:line, did-you-mean, batch sizes."""

from __future__ import annotations

import json

import pytest

from dsrun.errors import DsrunUsageError
from dsrun.launcher.configcheck import check_config, error_path, key_lines, launcher_view

GOOD = {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": 2}}


def _write(tmp_path, obj_or_text) -> str:
    path = tmp_path / "ds_config.json"
    text = obj_or_text if isinstance(obj_or_text, str) else json.dumps(obj_or_text, indent=2)
    path.write_text(text)
    return str(path)


def test_key_lines_follow_nesting_and_arrays():
    text = ('{\n  "a": 1,\n  "zero_optimization": {\n    "stage": 2,\n'
            '    "offload_optimizer": {"device": "cpu"}\n  },\n'
            '  "list": [{"x": 1},\n {"x": "a\\"b"}],\n  "b": "}"\n}\n')
    lines = key_lines(text)
    assert lines[("a",)] == 2
    assert lines[("zero_optimization",)] == 3
    assert lines[("zero_optimization", "stage")] == 4
    assert lines[("zero_optimization", "offload_optimizer", "device")] == 5
    assert lines[("list", "0", "x")] == 7 and lines[("list", "1", "x")] == 8
    assert lines[("b",)] == 9


@pytest.mark.parametrize("message,path", [
    ('unknown key "trian_batch_size" in c.json; did you mean "train_batch_size"?',
     ("trian_batch_size",)),
    ('unknown key "stgae" in "zero_optimization" of c.json; did you mean "stage"?',
     ("zero_optimization", "stgae")),
    ('"zero_optimization.stage" in c.json must be an integer in 0..3, got 7',
     ("zero_optimization", "stage")),
    ("nothing to point at", ()),
])
def test_error_path(message, path):
    assert error_path(message) == path


def test_good_config_passes(tmp_path):
    check_config(_write(tmp_path, GOOD), 4, {})


def test_misspelled_key_names_file_line_and_the_right_key(tmp_path):
    cfg = {**GOOD, "zero_optimization": {"stgae": 2}}
    path = _write(tmp_path, cfg)
    with pytest.raises(DsrunUsageError) as err:
        check_config(path, 4, {})
    text = str(err.value)
    line = 1 + open(path).read().split('"stgae"')[0].count("\n")
    assert line > 2
    assert text.startswith(f"--config {path}:{line}: unknown key \"stgae\"")
    assert 'did you mean "stage"?' in text
    assert "\n" not in text  # one line


def test_top_level_typo(tmp_path):
    path = _write(tmp_path, {"trian_batch_size": 8})
    with pytest.raises(DsrunUsageError, match=rf'{path}:2: unknown key "trian_batch_size".*'
                                              r'did you mean "train_batch_size"'):
        check_config(path, 2, {})


def test_batch_size_that_fits_no_data_parallel_size(tmp_path):
    path = _write(tmp_path, {"train_batch_size": 7, "train_micro_batch_size_per_gpu": 2})
    with pytest.raises(DsrunUsageError) as err:
        check_config(path, 4, {})
    assert str(err.value).startswith(f"--config {path}:2: ")
    assert "data-parallel size 4" in str(err.value)


def test_batch_size_that_fits_a_divisor_of_the_world_passes(tmp_path):
    # 2 pipeline stages x 2 data-parallel ranks: the script's mpu says dp = 2
    path = _write(tmp_path, {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2,
                             "gradient_accumulation_steps": 2})
    warning = check_config(path, 4, {})
    assert warning is not None and warning.startswith(f"warning: --config {path}:")
    assert "data-parallel size 4" in warning and "it fits 2 data-parallel rank(s)" in warning
    assert check_config(path, 2, {}) is None  # fits the world size itself: nothing to say


def test_auto_micro_batch_is_judged_only_as_far_as_the_launcher_can(tmp_path):
    ok = _write(tmp_path, {"train_batch_size": 16, "train_micro_batch_size_per_gpu": "auto",
                           "gradient_accumulation_steps": 2})
    check_config(ok, 4, {})
    assert launcher_view({"train_micro_batch_size_per_gpu": "auto"}) == {
        "train_micro_batch_size_per_gpu": 1}
    bad = _write(tmp_path, {"train_batch_size": 6, "train_micro_batch_size_per_gpu": "auto",
                            "gradient_accumulation_steps": 4})
    with pytest.raises(DsrunUsageError, match="not divisible"):
        check_config(bad, 1, {})


def test_unknown_keys_allowed_by_the_environment(tmp_path):
    path = _write(tmp_path, {**GOOD, "my_own_key": 1})
    with pytest.raises(DsrunUsageError):
        check_config(path, 2, {})
    check_config(path, 2, {"DSRUN_ALLOW_UNKNOWN_CONFIG_KEYS": "1"})


@pytest.mark.parametrize("text,message", [
    ('{"a": 1,\n  "b": }', ":2:8: not valid JSON"),
    ('{"a": 1, "a": 2}', 'duplicate key "a"'),
])
def test_bad_json(tmp_path, text, message):
    with pytest.raises(DsrunUsageError, match=message):
        check_config(_write(tmp_path, text), 1, {})
