"""Root-cause selection and the report text (pure)."""

from __future__ import annotations

from dsrun.launcher.report import JobResult, RankFailure, report_lines, root_cause


def _f(rank, t, code=1, sig=None, during_stop=False, host="h", **kw):
    return RankFailure(host=host, rank=rank, code=code, signal=sig, time=t,
                       during_stop=during_stop, **kw)


def test_earliest_genuine_failure_wins_over_earlier_consequences():
    consequence = _f(0, 1.0, during_stop=True)
    genuine_late = _f(1, 2.0, code=3)
    genuine_early = _f(2, 1.5, code=4, host="h2")
    assert root_cause([consequence, genuine_late, genuine_early]) is genuine_early


def test_only_consequences_falls_back_to_earliest():
    a, b = _f(0, 2.0, during_stop=True), _f(1, 1.0, during_stop=True)
    assert root_cause([a, b]) is b
    assert root_cause([]) is None


def test_exit_codes():
    assert _f(0, 0, code=3).exit_code == 3
    assert _f(0, 0, code=None, sig=11).exit_code == 139
    assert JobResult((_f(0, 0, code=None, sig=9),)).exit_code == 137
    assert JobResult(interrupted=2).exit_code == 130
    assert JobResult().exit_code == 0


def test_report_names_rank_host_signal_traceback_and_tail():
    tb = "Traceback (most recent call last):\n  File \"t.py\", line 1\nValueError: boom\n"
    cause = _f(3, 1.0, code=1, host="node2", error={"traceback": tb, "time_str": "T"},
               tail=("step 1", "step 2", "Traceback (most recent call last):",
                     "  File \"t.py\", line 1", "ValueError: boom"))
    other = _f(0, 2.0, code=None, sig=15, during_stop=True)
    lines = report_lines(JobResult((other, cause)))
    assert lines[0] == "job failed: rank 3 on host node2 failed first: exit code 1"
    assert "  ValueError: boom" in lines
    assert "  [node2:3] step 2" in lines
    assert sum("ValueError: boom" in ln for ln in lines) == 1  # traceback not repeated
    assert "1 other rank(s) stopped as a consequence" in lines
    assert lines[-1] == "exit code 1"
    seg = report_lines(JobResult((_f(1, 1.0, code=None, sig=11),)))
    assert seg[0].endswith("killed by signal SIGSEGV")


def test_a_rank_raising_the_same_error_after_the_stop_began_failed_with_it():
    error = {"exc_type": "DsrunConfigError", "message": 'unknown key "x"', "traceback": ""}
    cause = _f(0, 1.0, code=1, error=error)
    raised_late = _f(1, 1.01, code=1, during_stop=True, error=dict(error))
    lines = report_lines(JobResult((cause, raised_late)))
    assert "1 other rank(s) failed with the same error" in lines
    assert not any("as a consequence" in ln for ln in lines)
    # its record was written, then the teardown's signal ended it: it failed too
    killed = _f(1, 1.01, code=None, sig=15, during_stop=True, error=dict(error))
    lines = report_lines(JobResult((cause, killed)))
    assert "1 other rank(s) failed with the same error" in lines
    # stopped before it got there: no record
    stopped = _f(1, 1.01, code=None, sig=15, during_stop=True)
    assert "1 other rank(s) stopped as a consequence" in report_lines(JobResult((cause, stopped)))
    # another error after the stop began: a consequence
    other = _f(1, 1.01, code=1, during_stop=True,
               error={"exc_type": "RuntimeError", "message": "connection closed"})
    assert "1 other rank(s) stopped as a consequence" in report_lines(JobResult((cause, other)))


def test_a_signal_to_the_agent_is_the_cause_of_the_exits_it_brings():
    """The agent's ``signal`` event comes before the exits of the ranks it
    stops (during_stop); a rank that failed on its own before it still wins."""
    signalled = RankFailure.from_signal_event(
        "vm", {"ev": "signal", "signal": 15, "time": 5.0, "age": 0.0, "_recv": 10.0})
    stopped = RankFailure.from_event("vm", {"rank": 1, "code": None, "signal": 15,
                                            "during_stop": True, "_recv": 10.2})
    result = JobResult((signalled, stopped))
    assert result.root_cause is signalled and result.exit_code == 143
    lines = report_lines(result)
    assert lines[0] == ("job failed: node agent on host vm got SIGTERM (a signal to the "
                        "agent, not a rank failure); it stopped its ranks")
    assert "1 other rank(s) stopped as a consequence" in lines
    failed = RankFailure.from_event("vm", {"rank": 0, "code": 3, "_recv": 9.0})
    assert root_cause([signalled, stopped, failed]) is failed
