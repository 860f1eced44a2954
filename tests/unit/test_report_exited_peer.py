"""The report names a rank's early exit as the cause when another rank's
error names that exit (a checkpoint call waiting for it: runtime/exitmark.py),
however long before it came (pure)."""

from __future__ import annotations

from dsrun.errors import RANK_LOST
from dsrun.launcher.report import JobResult, RankFailure, report_lines

WAITED = ("engine.save_checkpoint() failed on rank 0: rank 1 exited (status 0) before calling "
          f"engine.save_checkpoint() (every rank must call it; {RANK_LOST} while the others "
          "waited for it). Nothing was written; the previous checkpoint and 'latest' are intact")


def failed(message: str, recv: float) -> RankFailure:
    error = {"exc_type": "CheckpointError", "message": message, "time_str": "12:00:30",
             "traceback": f"Traceback ...\nCheckpointError: {message}\n"}
    return RankFailure.from_event("vm", {"rank": 0, "code": 1, "_recv": recv, "error": error})


def test_an_exit_named_by_the_error_is_the_cause_beyond_the_window():
    """Rank 1 exited 30 s before rank 0 reached save_checkpoint (an
    evaluation in between): past EARLY_EXIT_WINDOW, yet rank 0's error says
    it waited for rank 1."""
    early = RankFailure.from_event("vm", {"rank": 1, "code": 0, "_recv": 10.0})
    result = JobResult((failed(WAITED, 40.0),), early_exits=(early,))
    assert result.root_cause is early and result.exit_code == 1
    lines = report_lines(result)
    assert lines[0] == ("job failed: rank 1 on host vm exited with status 0 while other ranks "
                        "were still running (the likely cause)")
    assert lines[1] == ("then, 30.0s later, rank 0 on host vm failed (CheckpointError): it was "
                        "still waiting for rank 1 (its error says so)")

    # another rank's exit is not taken for the one named
    other = RankFailure.from_event("vm", {"rank": 2, "code": 0, "_recv": 10.0})
    waiting = failed(WAITED, 40.0)
    assert JobResult((waiting,), early_exits=(other,)).root_cause is waiting
