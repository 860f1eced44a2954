"""Real processes: the node agent's temporary directory under an unusable
or relative TMPDIR (one rank, --dist_backend none)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import run_dsrun

pytestmark = pytest.mark.proc
ONE = ["--cpu", "--num_gpus", "1", "--dist_backend", "none"]


def test_a_missing_tmpdir_falls_back_and_the_job_runs(tmp_path: Path):
    script = tmp_path / "ok.py"
    script.write_text("print('ran fine')\n")
    res = run_dsrun(*ONE, str(script), env={"TMPDIR": str(tmp_path / "missing" / "tmp")})
    assert res.returncode == 0, res.stderr
    assert "ran fine" in res.stdout and "Traceback" not in res.stderr


def test_a_relative_tmpdir_keeps_the_error_file_of_a_rank_that_changes_directory(
        tmp_path: Path):
    (tmp_path / "rel").mkdir()
    (tmp_path / "elsewhere").mkdir()
    script = tmp_path / "chd.py"
    script.write_text("import os\n"
                      f"os.chdir({str(tmp_path / 'elsewhere')!r})\n"
                      "raise ValueError('boom after chdir')\n")
    res = run_dsrun(*ONE, str(script), env={"TMPDIR": "rel"}, cwd=str(tmp_path))
    assert res.returncode == 1, res.stderr
    # From the rank's error file, not the output tail the report falls back to.
    assert "error in rank 0 at" in res.stderr, res.stderr
    assert list((tmp_path / "elsewhere").iterdir()) == []
