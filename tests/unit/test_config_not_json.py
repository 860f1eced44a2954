"""Config files are strict JSON: a YAML file, or the comments, trailing
commas and unquoted keys DeepSpeed's hjson reader takes, get a hint saying
so - from initialize()'s reader and from the launcher's ``--config`` check."""

from __future__ import annotations

from pathlib import Path

import pytest

from dsrun.errors import DsrunConfigError, DsrunUsageError
from dsrun.launcher.configcheck import check_config
from dsrun.runtime.config import load_config

STRICT = "config files are strict JSON: no comments or trailing commas"
CASES = [
    ("ds.yaml", "train_batch_size: 8\nzero_optimization:\n  stage: 2\n", "not YAML"),
    ("ds.yml", "train_batch_size: 8\n", "not YAML"),
    ("ds.json", '{\n  // the batch\n  "train_batch_size": 8\n}\n', STRICT),
    ("ds.json", '{\n  # the batch\n  "train_batch_size": 8\n}\n', STRICT),
    ("ds.json", '{\n  /* the batch */ "train_batch_size": 8\n}\n', STRICT),
    ("ds.json", '{"train_batch_size": 8,\n "optimizer": {"type": "Adam",},}\n', STRICT),
    ("ds.hjson", "{\n  train_batch_size: 8\n}\n", STRICT),
]


@pytest.mark.parametrize("name,text,hint", CASES)
def test_the_error_says_what_is_read(tmp_path: Path, name: str, text: str, hint: str) -> None:
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(DsrunConfigError, match=rf"{path}: line \d+, column \d+: invalid JSON.*"
                                               f"{hint}"):
        load_config(str(path))
    with pytest.raises(DsrunUsageError, match=rf"--config {path}:\d+:\d+: not valid JSON.*"
                                              f"{hint}"):
        check_config(str(path), 1, {})


@pytest.mark.parametrize("text", ['{"train_batch_size": }',
                                  '{"path": "/data/*" "train_batch_size": 1}',
                                  '{"url": "http://h/#x" "a": 1}'])
def test_plain_broken_json_gets_no_hint(tmp_path: Path, text: str) -> None:
    """Comment-like text inside a JSON string is not a comment."""
    path = tmp_path / "ds.json"
    path.write_text(text)
    with pytest.raises(DsrunConfigError) as err:
        load_config(str(path))
    assert "strict JSON" not in str(err.value) and "YAML" not in str(err.value)


def test_a_byte_order_mark_is_read(tmp_path: Path) -> None:
    """Windows editors save JSON with a UTF-8 BOM; DeepSpeed's hjson reader
    takes it, so initialize() and the launcher's --config check do too (line
    numbers of later errors still count from the file's first line)."""
    path = tmp_path / "ds.json"
    path.write_bytes(b'\xef\xbb\xbf{"train_batch_size": 8}\n')
    assert load_config(str(path))[0] == {"train_batch_size": 8}
    check_config(str(path), 1, {})
    path.write_bytes(b'\xef\xbb\xbf{\n "train_batch_size": 8,\n'
                     b' "zero_optimization": {"stag": 1}}\n')
    with pytest.raises(DsrunUsageError, match=rf"--config {path}:3: .*stag"):
        check_config(str(path), 1, {})
