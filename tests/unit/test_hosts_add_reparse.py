"""`dsrun hosts` edits read back what they wrote and parse it with the
parser a job uses before it replaces the hostfile: an edit whose result a
launch would refuse leaves the old file intact (an edit bug, simulated
here by an add_host that writes a broken line)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from click.testing import CliRunner

from dsrun.launcher import hostfile as hf
from dsrun.launcher.hosts_cli import hosts

TEXT = "# rack A\nworker-0 slots=8\n"


@pytest.fixture
def workdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    monkeypatch.setattr(hf, "DEFAULT_JOB_HOSTFILE", str(tmp_path / "job" / "hostfile"))
    return work


def _broken_add(text: str, host: str, slots: int, path: str = "hostfile") -> str:
    return f"{text}{host} slots={slots}\n{host} slots=two\n"  # a duplicate, a bad count


def test_an_add_whose_result_would_not_parse_leaves_the_old_file(workdir, monkeypatch) -> None:
    (workdir / "hostfile").write_text(TEXT)
    monkeypatch.setattr(hf, "add_host", _broken_add)
    result = CliRunner().invoke(hosts, ["add", "worker-1", "--slots", "4"])
    assert result.exit_code == 2, result.output
    assert "refusing to write hostfile './hostfile'" in result.output
    assert "is left unchanged" in result.output and "slots must be a positive integer" \
        in result.output
    assert (workdir / "hostfile").read_text() == TEXT
    assert sorted(os.listdir(workdir)) == ["hostfile"]  # no temporary file left


def test_an_add_that_would_create_an_unparsable_file_creates_none(workdir, monkeypatch) -> None:
    monkeypatch.setattr(hf, "add_host", _broken_add)
    result = CliRunner().invoke(hosts, ["add", "worker-1", "--slots", "4"])
    assert result.exit_code == 2, result.output
    assert "is not created" in result.output
    assert os.listdir(workdir) == []


def test_a_good_add_is_written_and_parses(workdir) -> None:
    (workdir / "hostfile").write_text(TEXT)
    result = CliRunner().invoke(hosts, ["add", "worker-1", "--slots", "4"])
    assert result.exit_code == 0, result.output
    assert hf.load_hostfile(str(workdir / "hostfile")).hosts == ("worker-0", "worker-1")
