"""The node agent's line naming the job's processes (not ranks) that its
teardown stopped after the ranks ended or with SIGKILL."""

from __future__ import annotations

from dsrun.launcher.agent_leftovers import leftover_line
from dsrun.launcher.procs import Described, Proc

GROUPS = {100: 0, 200: 1}  # rank leader pid (its group) -> rank


def _d(pid: int, command: str, group: int | None, rank: str | None = None) -> Described:
    return Described(Proc(pid, 1.0), command, group, rank)


def test_nothing_stopped_says_nothing():
    assert leftover_line([], [], True, GROUPS) is None


def test_an_upload_left_after_success_is_named_with_its_rank_and_short_command():
    upload = _d(1234, "/usr/bin/sh -c 'sleep 3; echo uploaded > /data/out/a/very/long/path'",
                4321, "0")  # its own session: told by RANK
    assert leftover_line([upload], [], True, GROUPS) == (
        "stopped 1 process that rank 0 left running after the job ended: "
        "pid 1234 (sh -c 'sleep 3; echo uploaded > /data...)")


def test_more_than_three_are_counted_and_sigkill_is_said():
    left = [_d(p, "sleep 60", 100 if p % 2 else 200) for p in range(11, 16)]
    line = leftover_line(left, left[:2], False, GROUPS)
    assert line == ("stopped 5 processes that ranks 0, 1 left running after the ranks exited "
                    "(2 of them with SIGKILL): pid 11 (sleep 60), pid 12 (sleep 60), "
                    "pid 13 (sleep 60) and 2 more")
    assert "(all with SIGKILL)" in leftover_line(left, left, False, GROUPS)


def test_killed_while_the_ranks_ran_and_of_no_known_rank():
    killed = [_d(7, "python -c pass", 100), _d(8, "daemon", 999, None)]
    assert leftover_line([], killed, False, GROUPS) == (
        "2 processes started by the ranks needed SIGKILL: pid 7 (python -c pass), "
        "pid 8 (daemon)")
    both = leftover_line([_d(9, "sh", 200)], killed[:1], True, GROUPS)
    assert both == ("stopped 1 process that rank 1 left running after the job ended: "
                    "pid 9 (sh); 1 process started by rank 0 needed SIGKILL: "
                    "pid 7 (python -c pass)")
