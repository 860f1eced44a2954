"""Two jobs with one --log_dir (agent_os): the second is refused, naming the
running job, before any of its ranks starts; the files are free again once
the first job's agent has closed them."""

from __future__ import annotations

from pathlib import Path

import pytest

from dsrun.launcher.agent_os import LogOpenError, log_files_problem, open_rank_logs

HEADER = "# dsrun job {} restart 0 host hostA 2026-11-25 08:00:00\n"
FIRST = "0426a2d84dfd400483985eae25d3b50c"


def test_a_second_job_cannot_open_log_files_a_running_job_writes(tmp_path: Path):
    first = open_rank_logs(str(tmp_path), [0, 1], HEADER.format(FIRST))
    try:
        with pytest.raises(LogOpenError) as caught:
            open_rank_logs(str(tmp_path), [2, 1], HEADER.format("f" * 32))
        message = str(caught.value)
        assert f"{tmp_path / 'rank_1.log'} is being written by another running dsrun job" \
            in message
        assert f"job id {FIRST[:12]} (on hostA, since 2026-11-25 08:00:00)" in message
        assert "another --log_dir" in message
        # All or none: rank 2's file got no header of the refused job.
        assert (tmp_path / "rank_2.log").read_text() == ""
    finally:
        for log in first.values():
            log.close()
    again = open_rank_logs(str(tmp_path), [1, 2], HEADER.format("f" * 32))
    for log in again.values():
        log.close()
    # Appended after the first job's lines, as for restarts.
    assert (tmp_path / "rank_1.log").read_text().splitlines() == \
        [HEADER.format(FIRST).strip(), HEADER.format("f" * 32).strip()]


def test_the_preflight_check_names_the_running_job_and_leaves_its_lock(tmp_path: Path):
    paths = [str(tmp_path / "rank_0.log"), str(tmp_path / "rank_1.log")]
    assert log_files_problem(paths) is None
    first = open_rank_logs(str(tmp_path), [1], HEADER.format(FIRST))
    try:
        problem = log_files_problem(paths)
        assert problem is not None and "rank_1.log is being written by another running " \
            f"dsrun job, job id {FIRST[:12]}" in problem
        assert log_files_problem(paths) == problem  # the check took nothing away
    finally:
        for log in first.values():
            log.close()
    assert log_files_problem(paths) is None
    assert not (tmp_path / "rank_0.log").exists()


def test_a_lock_held_by_something_else_is_named_so(tmp_path: Path):
    import fcntl

    (tmp_path / "rank_0.log").write_text("some other program's lines\n")
    with open(tmp_path / "rank_0.log", "a") as other:
        fcntl.flock(other.fileno(), fcntl.LOCK_EX)
        problem = log_files_problem([str(tmp_path / "rank_0.log")])
    assert problem is not None and "another running process (no dsrun job header" in problem
