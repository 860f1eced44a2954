"""Real processes: the end of a job that was restarted says so, and each
attempt's ranks get torchrun's TORCHELASTIC_RESTART_COUNT and
TORCHELASTIC_MAX_RESTARTS (explore22-nodeckpt finding 6: the report never
mentioned the restarts, and the ranks saw only DSRUN_RESTART_COUNT)."""

from __future__ import annotations

import pytest

from tests.conftest import WORKERS, run_dsrun

pytestmark = pytest.mark.proc
WORKER = str(WORKERS / "restart_env.py")


def _job(*extra: str) -> list[str]:
    return ["--cpu", "--num_gpus", "2", "--dist_backend", "none", "--kill_grace", "1",
            "--max_restarts", "1", *extra]


def test_a_job_that_succeeds_after_a_restart_says_so_and_its_ranks_know_the_attempt():
    res = run_dsrun(*_job(WORKER))
    assert res.returncode == 0, res.stderr
    assert res.stderr.rstrip().endswith("dsrun: job succeeded after 1 restart(s) (attempt 2)"), \
        res.stderr
    out = res.stdout
    assert "attempt 0: TORCHELASTIC_RESTART_COUNT=0 TORCHELASTIC_MAX_RESTARTS=1" in out, out
    assert "attempt 1: TORCHELASTIC_RESTART_COUNT=1 TORCHELASTIC_MAX_RESTARTS=1" in out, out


def test_a_job_that_used_every_restart_says_so_before_its_report():
    res = run_dsrun(*_job(WORKER, "--fail_until", "9"))
    assert res.returncode == 4, res.stderr
    used = "dsrun: attempt 2 failed too: all 1 restart(s) used (--max_restarts 1)"
    assert used in res.stderr, res.stderr
    assert res.stderr.index(used) < res.stderr.index("job failed: rank 1 on host"), res.stderr


def test_a_torchelastic_variable_the_user_sets_is_left_alone():
    res = run_dsrun("--env", "TORCHELASTIC_MAX_RESTARTS=9", *_job(WORKER))
    assert res.returncode == 0, res.stderr
    assert "attempt 1: TORCHELASTIC_RESTART_COUNT=1 TORCHELASTIC_MAX_RESTARTS=9" in res.stdout
