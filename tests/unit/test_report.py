"""Root-cause selection and the report text (pure)."""

from __future__ import annotations

from dsrun.errors import RANK_LOST
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


GLOO_RESET = ("[gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:57555: Connection reset "
              "by peer. This is typically caused by a remote worker hanging")


def _exit_event(rank, recv, age, code=1, sig=None, error=None):
    return RankFailure.from_event("vm", {"rank": rank, "code": code, "signal": sig,
                                         "time": 0.0, "age": age, "_recv": recv,
                                         "error": error})


def test_a_peer_reset_stamped_before_the_death_that_caused_it_is_not_blamed():
    """A race: rank 1 died by os._exit(3) (no record); its
    closed socket woke rank 0, whose record is stamped when gloo raised,
    while rank 1 is stamped only when its agent's wait thread woke up."""
    reset = {"exc_type": "RuntimeError", "message": GLOO_RESET, "traceback": "Traceback ...\n"
             f"RuntimeError: {GLOO_RESET}\n"}
    peer = _exit_event(0, recv=10.0, age=0.050, error=reset)  # seen 9.950
    dead = _exit_event(1, recv=10.0, age=0.020, code=3)  # seen 9.980: "later"
    assert peer.peer_loss and not dead.peer_loss
    for failures in ([peer, dead], [dead, peer]):
        result = JobResult(tuple(failures))
        assert result.root_cause is dead and result.exit_code == 3
        lines = report_lines(result)
        assert lines[0] == "job failed: rank 1 on host vm failed first: exit code 3"
        assert ("1 other rank(s) failed as a consequence: their connection to a rank that "
                "went away was closed") in lines
        assert not any("stopped as a consequence" in ln for ln in lines)
    # by signal (SIGSEGV, SIGKILL): the same
    segv = _exit_event(1, recv=10.2, age=0.0, code=None, sig=11)
    assert JobResult((peer, segv)).exit_code == 139
    # dsrun's checkpoint exchange with a dead rank, and NCCL's remote error
    ckpt = {"exc_type": "CheckpointError", "message": "CheckpointError: ranks could not "
            "exchange checkpoint status: [unbound_buffer.cc:81] Timed out waiting 1800000ms for "
            f"recv operation to complete ({RANK_LOST} during the save or load)",
            "traceback": ""}
    nccl = {"exc_type": "DistBackendError", "message": "NCCL error: remote process exited or "
            "there was a network error, NCCL version 2.21.5\nncclRemoteError: ..."}
    for error in (ckpt, nccl):
        consequence = _exit_event(0, recv=10.0, age=0.3, error=error)
        assert root_cause([consequence, _exit_event(1, recv=10.1, age=0.0, sig=9,
                                                    code=None)]).rank == 1


def test_a_peer_reset_is_blamed_when_nothing_else_failed_near_it():
    reset = {"exc_type": "RuntimeError", "message": GLOO_RESET}
    peer = _exit_event(0, recv=10.0, age=0.0, error=reset)
    stopped = RankFailure.from_event("vm", {"rank": 1, "code": None, "signal": 15,
                                            "during_stop": True, "_recv": 10.1})
    result = JobResult((peer, stopped))
    assert result.root_cause is peer  # a teardown's SIGTERM is no cause
    lines = report_lines(result)
    assert any("lost a peer" in ln for ln in lines)
    # an unrelated failure long after it is not the cause either
    late = _exit_event(1, recv=30.0, age=0.0, code=5)
    assert root_cause([late, peer]) is peer
    # a genuine error of its own, before the peer loss, stays first
    own = _exit_event(1, recv=9.0, age=0.0, code=2,
                      error={"exc_type": "ValueError", "message": "boom"})
    assert root_cause([peer, own]) is own


def test_summary_and_which_errors_a_restart_cannot_clear():
    from dsrun.launcher.report import restartable

    tb = "Traceback (most recent call last):\n  File \"t.py\", line 1\nValueError: boom\n"
    assert _f(0, 1.0, error={"traceback": tb, "message": "boom"}).summary() == \
        "ValueError: boom"
    ck = {"exc_type": "CheckpointError", "message": "CheckpointError: no tag\nmore",
          "traceback": ""}
    assert _f(0, 1.0, error=ck).summary() == "CheckpointError: no tag"
    assert _f(0, 1.0).summary() == ""
    assert restartable(_f(0, 1.0, error=ck)) and restartable(_f(0, 1.0)) and restartable(None)
    config = {"exc_type": "DsrunConfigError", "message": 'DsrunConfigError: unknown key "x"'}
    assert not restartable(_f(0, 1.0, error=config))


def test_a_timeout_across_restarts_says_so():
    from dsrun.launcher.report import RunningRank

    result = JobResult(timed_out=8.0, restarts=1, running=(RunningRank("h", 3, 7, 2.0),))
    assert report_lines(result)[:2] == [
        "job timed out after 8s (--timeout, counted from the first of 2 attempts): "
        "1 rank(s) still running", "  rank 3 on host h, pid 7, running for 2s"]
    # the deadline came while a restart's ranks were starting: not "0 still running"
    assert report_lines(JobResult(timed_out=8.0, starting=True))[0] == (
        "job timed out after 8s (--timeout): no rank had reported running yet (the attempt "
        "was starting)")
    assert report_lines(JobResult(timed_out=8.0))[0] == (
        "job timed out after 8s (--timeout): no rank still running")


def _signalled(recv, host="vm"):
    return RankFailure.from_signal_event(
        host, {"ev": "signal", "signal": 15, "time": 5.0, "age": 0.0, "_recv": recv})


def _stopped(rank, recv):
    return RankFailure.from_event("vm", {"rank": rank, "code": None, "signal": 15,
                                         "during_stop": True, "_recv": recv})


def test_mpirun_stopping_the_job_after_an_early_exit_names_that_rank():
    """rank 1 exits 0 without MPI_Finalize while rank 0 waits;
    mpirun then SIGTERMs every agent (one per rank). Rank 1 is the cause, exit 1."""
    early = RankFailure.from_event("vm", {"rank": 1, "code": 0, "signal": None, "time": 0.0,
                                          "age": 0.0, "_recv": 10.0,
                                          "tail": ["rank 1 leaving"]})
    failures = (_signalled(10.2), _stopped(0, 10.3))
    result = JobResult(failures, early_exits=(early,), launcher="openmpi")
    assert result.root_cause is early and result.exit_code == 1
    lines = report_lines(result)
    assert lines[0] == ("job failed: rank 1 on host vm exited with status 0 while other ranks "
                        "were still running (the likely cause)")
    assert lines[1:3] == ["last 1 line(s) of rank 1's output:", "  [vm:1] rank 1 leaving"]
    assert lines[3].startswith("then, 0.2s later, the node agent on host vm got SIGTERM and "
                               "stopped its ranks: mpirun stops the job when one of its ranks "
                               "ends without calling MPI_Finalize")
    assert "1 other rank(s) stopped as a consequence" in lines
    assert lines[-1] == "exit code 1"
    # the same signal with no early exit, or one long before it: the signal is the cause
    assert JobResult(failures).root_cause is failures[0]
    long_before = RankFailure.from_event("vm", {"rank": 1, "code": 0, "_recv": 1.0})
    assert JobResult(failures, early_exits=(long_before,)).exit_code == 143
    # a genuine failure stays the cause
    failed = RankFailure.from_event("vm", {"rank": 0, "code": 3, "_recv": 10.1})
    assert root_cause([failed, *failures], [early]) is failed


def test_a_stop_signal_after_an_early_exit_claims_mpi_finalize_only_under_mpirun():
    """under ssh/local/slurm a signal within the window may be
    scancel or a preemption; the report says so instead of naming mpirun."""
    early = RankFailure.from_event("vm", {"rank": 1, "code": 0, "_recv": 10.0})
    failures = (_signalled(10.2), _stopped(0, 10.3))
    for launcher in ("ssh", "slurm", "local", ""):
        lines = report_lines(JobResult(failures, early_exits=(early,), launcher=launcher))
        then = next(ln for ln in lines if ln.startswith("then, 0.2s later"))
        assert "MPI_Finalize" not in then and "mpirun" not in then
        assert "scancel" in then and "at most 5s before" in then


def test_a_rank_losing_a_peer_that_exited_just_before_names_the_peer_and_shows_its_error():
    """The gloo variant: rank 1 exits 0, rank 0's collective loses it at once.
    Rank 1 is named as the likely cause; rank 0's traceback and output stay."""
    reset = {"exc_type": "RuntimeError", "message": GLOO_RESET, "time_str": "12:00:01",
             "traceback": f"Traceback ...\nRuntimeError: {GLOO_RESET}\n"}
    peer = RankFailure.from_event("vm", {"rank": 0, "code": 1, "_recv": 12.0, "error": reset,
                                         "tail": ["step 7", "Traceback (most recent call "
                                                  "last):"]})
    early = RankFailure.from_event("vm", {"rank": 1, "code": 0, "_recv": 10.0})
    result = JobResult((peer,), early_exits=(early,))
    assert result.root_cause is early and result.trigger is peer and result.exit_code == 1
    lines = report_lines(result)
    assert lines[0] == ("job failed: rank 1 on host vm exited with status 0 while other ranks "
                        "were still running (the likely cause)")
    assert lines[1] == ("then, 2.0s later, rank 0 on host vm failed (RuntimeError): it lost "
                        "its connection to a peer (a rank that ends while the others still "
                        "expect it in a collective makes them fail)")
    assert lines[2] == "error in rank 0 at 12:00:01 (vm's clock):"
    assert f"  RuntimeError: {GLOO_RESET}" in lines
    assert "  [vm:0] step 7" in lines
    assert not any("other rank(s)" in ln or "lost a peer, and" in ln for ln in lines)
    # an exit after the loss (beyond the stamping slack) did not cause it
    after = RankFailure.from_event("vm", {"rank": 1, "code": 0, "_recv": 50.0})
    assert JobResult((peer,), early_exits=(after,)).root_cause is peer


def test_a_rank_that_finished_long_before_an_unrelated_reset_is_not_blamed():
    """rank 1 finished legitimately; an hour later rank 0's own
    upload fails with "Connection reset by peer". Rank 0 is the cause (its
    exit code, its traceback); rank 1 is only mentioned."""
    upload = {"exc_type": "ConnectionResetError",
              "message": "[Errno 104] Connection reset by peer", "time_str": "13:00:00",
              "traceback": "Traceback ...\nConnectionResetError: [Errno 104] Connection reset "
                           "by peer\n"}
    failed = RankFailure.from_event("vm", {"rank": 0, "code": 2, "_recv": 3610.0,
                                           "error": upload})
    early = RankFailure.from_event("vm", {"rank": 1, "code": 0, "_recv": 10.0})
    result = JobResult((failed,), early_exits=(early,))
    assert result.root_cause is failed and result.trigger is None and result.exit_code == 2
    lines = report_lines(result)
    assert lines[0] == "job failed: rank 0 on host vm failed first: exit code 2"
    assert "  ConnectionResetError: [Errno 104] Connection reset by peer" in lines
    assert ("(note: rank 1 on host vm had exited with status 0 3600.0s before; if this rank "
            "still expected it in a collective, that exit is the cause)") in lines
    assert not any("likely cause" in ln for ln in lines)
    # 30s is beyond the window too; 4s is within it
    assert root_cause([failed], [RankFailure.from_event("vm", {"rank": 1, "code": 0,
                                                                 "_recv": 3580.0})]) is failed
    assert root_cause([failed], [RankFailure.from_event("vm", {"rank": 1, "code": 0,
                                                                 "_recv": 3606.0})]).rank == 1


def test_only_ranks_are_counted_when_every_agent_was_signalled():
    """with one agent per rank (mpirun, srun), scancel signals
    both agents; the second agent's record is not a third rank."""
    failures = (_signalled(10.0), _signalled(10.01), _stopped(0, 10.1), _stopped(1, 10.1))
    lines = report_lines(JobResult(failures))
    assert "2 other rank(s) stopped as a consequence" in lines
    assert not any("3 other" in ln for ln in lines)
