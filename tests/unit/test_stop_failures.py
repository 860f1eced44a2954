"""Which rank exits during a signal's stop were failures of their own
(stop_failures.py): named, while the stop's own doing is not."""

from __future__ import annotations

import signal

from dsrun.launcher.report import RankFailure, SigKilled
from dsrun.launcher.stop_failures import failed_of_its_own, own_failure_lines

TERM = int(signal.SIGTERM)


def _rank(rank: int, code: int | None = None, sig: int | None = None,
          error: dict | None = None, during_stop: bool = True) -> RankFailure:
    return RankFailure(host="a", rank=rank, code=code, signal=sig, time=0.0,
                       during_stop=during_stop, error=error)


def test_the_stop_s_own_doing_is_no_failure():
    ours = frozenset({("a", 4)})
    for f in [_rank(0, code=0), _rank(1, sig=TERM), _rank(2, sig=int(signal.SIGINT)),
              _rank(3, code=128 + TERM), _rank(4, sig=int(signal.SIGKILL)),
              _rank(5, code=1, error={"exc_type": "SystemExit", "message": "sys.exit(1)"}),
              _rank(6, code=130, error={"exc_type": "KeyboardInterrupt", "message": ""}),
              RankFailure(host="a", rank=None, code=None, signal=TERM, time=0.0,
                          during_stop=True, signalled=True)]:
        assert not failed_of_its_own(f, ours), f


def test_crashes_and_statuses_of_their_own_are_failures():
    ours = frozenset({("a", 4)})
    for f in [_rank(1, sig=int(signal.SIGSEGV)), _rank(2, code=3), _rank(3, code=1),
              _rank(5, sig=int(signal.SIGKILL)),  # not the agent's SIGKILL: the OOM killer
              _rank(6, code=1, error={"exc_type": "OSError", "message": "No space"})]:
        assert failed_of_its_own(f, ours), f


def test_the_lines_name_each_rank_and_what_it_means():
    failures = [_rank(0, code=0), _rank(1, sig=int(signal.SIGSEGV)),
                _rank(2, code=1, error={"exc_type": "OSError", "message": "No space"}),
                _rank(3, sig=int(signal.SIGKILL)), _rank(4, code=3, during_stop=False)]
    lines = own_failure_lines(failures, TERM, [SigKilled("a", (3,), "SIGTERM", False)])
    assert lines == [
        "rank 1 on host a failed during the stop (killed by signal SIGSEGV): a crash of its "
        "own, not SIGTERM's doing",
        "rank 2 on host a failed during the stop (exit code 1): No space",
        "2 rank(s) failed of their own while SIGTERM stopped the job (above: a crash, an "
        "error of their own, or a collective broken by the other ranks' stop): whatever they "
        "were doing on the signal (a save) may not have completed; the job still ends as "
        "stopped by SIGTERM, without a restart"]
    assert own_failure_lines([_rank(0, code=0), _rank(1, sig=TERM)], TERM) == []
