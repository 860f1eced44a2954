"""``dsrun doctor`` warns of an unusable TMPDIR on this host (doctor.py):
missing, a file, not writable; each with its fix. A usable or unset one
says nothing."""

from __future__ import annotations

import errno
import os
import tempfile

import pytest

from dsrun.launcher.doctor import tmpdir_problem


def test_a_missing_tmpdir_says_to_create_it(tmp_path) -> None:
    gone = tmp_path / "gone"
    text = tmpdir_problem({"TMPDIR": str(gone)})
    assert text is not None and text.startswith(f"TMPDIR={gone} does not exist: ")
    assert f"mkdir -p {gone}" in text and "node agent" in text


def test_a_relative_tmpdir_is_shown_with_its_full_path(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    text = tmpdir_problem({"TMPDIR": "scratch"})
    assert text is not None and text.startswith(f"TMPDIR=scratch ({tmp_path / 'scratch'}) "
                                                "does not exist")


def test_a_file_is_not_a_directory(tmp_path) -> None:
    (tmp_path / "f").write_text("")
    text = tmpdir_problem({"TMPDIR": str(tmp_path / "f")})
    assert text is not None and "is not a directory" in text and "export TMPDIR=/tmp" in text


def test_a_read_only_tmpdir_says_it_cannot_be_written(tmp_path, monkeypatch) -> None:
    def read_only(**kwargs: object) -> str:
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(kwargs.get("dir")))

    monkeypatch.setattr(tempfile, "mkdtemp", read_only)
    text = tmpdir_problem({"TMPDIR": str(tmp_path)})
    assert text is not None
    assert f"TMPDIR={tmp_path} cannot be written (Read-only file system)" in text
    assert f"chmod u+w {tmp_path}" in text


@pytest.mark.skipif(os.getuid() == 0, reason="root writes into a mode-555 directory")
def test_a_directory_without_write_permission_cannot_be_written(tmp_path) -> None:
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o555)
    text = tmpdir_problem({"TMPDIR": str(locked)})
    assert text is not None and "cannot be written (Permission denied)" in text


def test_a_usable_or_unset_tmpdir_says_nothing_and_leaves_nothing(tmp_path) -> None:
    assert tmpdir_problem({"TMPDIR": str(tmp_path)}) is None
    assert os.listdir(tmp_path) == []
    assert tmpdir_problem({}) is None and tmpdir_problem({"TMPDIR": ""}) is None
