"""The node agent's temporary directory (agent_os.make_tmpdir): an unusable
TMPDIR is passed over as tempfile passes it over, a relative one is made
absolute, and when nothing can be used the agent exits with one line."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from dsrun.launcher import agent_os


@pytest.fixture
def tmp_env(monkeypatch: pytest.MonkeyPatch):
    for var in ("TMPDIR", "TEMP", "TMP"):
        monkeypatch.delenv(var, raising=False)
    return monkeypatch


@pytest.mark.parametrize("bad", ["missing", "a_file"])
def test_an_unusable_tmpdir_falls_back_to_the_next_candidate(tmp_path: Path, tmp_env, bad):
    (tmp_path / "a_file").write_text("not a directory\n")
    ok = tmp_path / "ok"
    ok.mkdir()
    tmp_env.setenv("TMPDIR", str(tmp_path / bad))
    tmp_env.setenv("TEMP", str(ok))
    made = agent_os.make_tmpdir("dsrun-test-")
    assert os.path.dirname(made) == str(ok)
    assert os.stat(made).st_mode & 0o777 == 0o700


def test_a_relative_tmpdir_is_made_absolute(tmp_path: Path, tmp_env):
    (tmp_path / "rel").mkdir()
    tmp_env.chdir(tmp_path)
    tmp_env.setenv("TMPDIR", "rel")
    made = agent_os.make_tmpdir("dsrun-test-")
    # A rank that changes directory must still find its error file here.
    assert os.path.isabs(made) and os.path.dirname(made) == str(tmp_path / "rel")


def test_the_candidates_follow_tempfile(tmp_path: Path, tmp_env):
    tmp_env.chdir(tmp_path)
    tmp_env.setenv("TMPDIR", "x/../y")
    tmp_env.setenv("TMP", "/tmp")
    paths = [path for path, _ in agent_os.tmp_candidates()]
    assert paths == [str(tmp_path / "y"), "/tmp", "/var/tmp", "/usr/tmp", str(tmp_path)]


def test_nowhere_to_make_it_is_one_line_naming_tmpdir(tmp_path: Path, tmp_env):
    (tmp_path / "a_file").write_text("")
    gone = tmp_path / "gone"
    gone.mkdir()
    tmp_env.chdir(gone)
    gone.rmdir()  # a deleted working directory is no candidate
    tmp_env.setattr(agent_os, "_FALLBACK_TMP", (str(tmp_path / "nope"),))
    tmp_env.setenv("TMPDIR", str(tmp_path / "a_file"))
    with pytest.raises(SystemExit) as caught:
        agent_os.make_tmpdir("dsrun-test-")
    message = str(caught.value.code)
    assert "\n" not in message and message.startswith("dsrun: error: ")
    assert f"TMPDIR={tmp_path / 'a_file'}: Not a directory" in message
    assert f"{tmp_path / 'nope'}: No such file or directory" in message
