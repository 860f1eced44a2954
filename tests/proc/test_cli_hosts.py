"""The dsrun command line as a user types it (real processes, --dry-run and
doctor only): DeepSpeed's abbreviated flags, ``-H /dev/null`` despite a
./hostfile, and doctor given the job's own command line."""

from __future__ import annotations

from pathlib import Path

from tests.conftest import run_dsrun


def _workdir(tmp_path: Path) -> Path:
    (tmp_path / "hostfile").write_text("worker-0 slots=2\nworker-1 slots=2\n")
    (tmp_path / "t.py").write_text("pass\n")
    return tmp_path


def test_deepspeeds_abbreviations_and_dev_null_in_a_dry_run(tmp_path):
    work = _workdir(tmp_path)
    res = run_dsrun("--dry", "-H", "/dev/null", "--num_gpu", "1", "--cp", "t.py", "--num_gpu",
                    "9", cwd=str(work))
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    assert lines[0] == "no hostfile: this host only (-H /dev/null)"
    assert lines[1].startswith("world size 1 on 1 node(s)")
    assert "t.py --num_gpu 9" in res.stdout  # the script's own arguments, untouched


def test_doctor_with_the_jobs_command_line(tmp_path):
    work = _workdir(tmp_path)
    res = run_dsrun("doctor", "-H", "/dev/null", "--cpu", "--num_gpu", "1", "t.py", "--lr", "1",
                    cwd=str(work))
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith("checking 1 host(s) from <this host>")
    assert "all 1 host(s) ok" in res.stdout
    res = run_dsrun("doctor", "-H", "/dev/null", "--cpu", "gone.py", cwd=str(work))
    assert res.returncode == 2
    assert res.stderr == "dsrun: error: script 'gone.py' does not exist\n"
