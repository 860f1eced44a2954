"""How a job's end is told when something odd happened, without processes:
ranks the teardown had to SIGKILL (agents' ``done`` events -> the report
and the stop line), a write error on dsrun's stdout that is not a closed
pipe, the bounded output wait after a signal stopped the job, a stopped
rank's stack answer, and torchrun's output flags."""

from __future__ import annotations

import errno
import io
import os
import signal
import subprocess
import sys
import threading
import time

import click
import pytest

from dsrun.launcher import cli, cli_hints, launch, output_end
from dsrun.launcher.agent_os import stopped
from dsrun.launcher.console import Console, OutputFailed
from dsrun.launcher.launch import stopped_line
from dsrun.launcher.report import JobResult, RankFailure, SigKilled, report_lines, sigkill_lines
from dsrun.launcher.supervisor import SIGNALS
from dsrun.launcher.watch import stack_lines
from tests.conftest import ROOT
from tests.unit.test_agent_fail_events import ScriptedChannel, _supervise


def _done_with(host: str, rank: int, killed: list[int], after: str = "SIGINT",
               at_once: bool = False) -> list[dict]:
    return [{"ev": "hello", "host": host}, {"ev": "started", "rank": rank, "pid": 10 + rank},
            {"ev": "exit", "rank": rank, "code": None, "signal": 9, "time": 0.0, "age": 0.0,
             "during_stop": True, "error": None, "tail": []},
            {"ev": "done", "killed": len(killed), "sigkilled": killed, "after": after,
             "at_once": at_once}]


def test_the_ranks_each_agent_sigkilled_reach_the_result():
    result = _supervise(ScriptedChannel("a", _done_with("a", 0, [0])),
                        ScriptedChannel("b", _done_with("b", 1, [])))
    assert result.sigkilled == (SigKilled("a", (0,), "SIGINT", False),)
    assert result.kill_grace == 0.1


def test_sigkilled_ranks_are_named_by_host_with_the_grace_and_the_signal():
    result = JobResult(interrupted=signal.SIGINT, kill_grace=2.0, sigkilled=(
        SigKilled("a", (0, 1), "SIGINT", False), SigKilled("b", (5, 4, 6, 9), "SIGINT", False)))
    assert sigkill_lines(result) == [
        "rank 0, 1 on host a; rank 4-6, 9 on host b still running --kill_grace 2s after "
        "SIGINT: killed with SIGKILL (anything they still did - a save in except "
        "KeyboardInterrupt, finally, atexit - was cut off; a longer --kill_grace helps only "
        "a rank that was acting on SIGINT, a save in a handler: one blocked in C code - a "
        "CUDA call, an NCCL collective - never sees it)"]
    assert stopped_line(result) == \
        "stopped by SIGINT; every rank was stopped (6 of them with SIGKILL)"
    assert stopped_line(JobResult(interrupted=signal.SIGINT)) == \
        "stopped by SIGINT; every rank was stopped"


def test_a_hurried_kill_is_told_apart_from_one_after_the_grace():
    result = JobResult(interrupted=signal.SIGTERM, kill_grace=5.0,
                       sigkilled=(SigKilled("a", (3,), "SIGTERM", True),))
    assert sigkill_lines(result) == [
        "rank 3 on host a killed with SIGKILL before --kill_grace ran out, after SIGTERM (a "
        "further signal hurried the stop): anything it still did - a SIGTERM handler, "
        "finally, atexit - was cut off"]


def test_the_failure_report_names_the_ranks_its_teardown_killed():
    cause = RankFailure(host="a", rank=1, code=2, signal=None, time=0.0, seen=1.0)
    stopped_rank = RankFailure(host="a", rank=0, code=None, signal=9, time=0.0,
                               during_stop=True, seen=2.0)
    result = JobResult(failures=(cause, stopped_rank), kill_grace=1.0,
                       sigkilled=(SigKilled("a", (0,), "SIGTERM", False),))
    lines = report_lines(result)
    assert lines[-2].startswith("rank 0 on host a still running --kill_grace 1s after "
                                "SIGTERM: killed with SIGKILL"), lines
    assert lines[-1] == "exit code 2"


class _Failing(io.StringIO):
    def __init__(self, error: OSError) -> None:
        super().__init__()
        self.error = error

    def write(self, text: str) -> int:
        raise self.error


def _wait_raises(c: Console, kind: type[BaseException]) -> BaseException:
    end = time.monotonic() + 5
    while time.monotonic() < end:
        try:
            c.pending()
        except kind as exc:
            return exc
        time.sleep(0.01)
    raise AssertionError(f"no {kind.__name__}")


def test_a_full_disk_under_stdout_is_an_output_failure_not_a_closed_pipe():
    c = Console(_Failing(OSError(errno.ENOSPC, "No space left on device")), io.StringIO(),
                tty=False)
    c.start_writer()
    c.line("h", 0, 1, "lost")
    exc = _wait_raises(c, OutputFailed)
    assert str(exc) == "cannot write to stdout: [Errno 28] No space left on device"
    with pytest.raises(OutputFailed):
        c.line("h", 0, 1, "more")
    c.close(wait=False)
    assert c.failure is not None and c.failure.error.errno == errno.ENOSPC
    direct = Console(_Failing(OSError(errno.EFBIG, "File too large")), io.StringIO(),
                     tty=False)
    with pytest.raises(OutputFailed, match=r"\[Errno 27\] File too large"):
        direct.line("h", 0, 1, "written at once")  # no writer threads: a direct write


def test_a_closed_pipe_stays_the_quiet_case():
    c = Console(_Failing(BrokenPipeError(errno.EPIPE, "Broken pipe")), io.StringIO(), tty=False)
    c.start_writer()
    c.line("h", 0, 1, "lost")
    exc = _wait_raises(c, BrokenPipeError)
    assert not isinstance(exc, OutputFailed)
    assert c.close(wait=False) is True and c.failure is None


def test_the_cli_says_an_output_failure_once_and_exits_1(monkeypatch, capfd):
    def fail(spec):  # noqa: ANN001 - a LaunchSpec
        raise OutputFailed(1, OSError(errno.ENOSPC, "No space left on device"))

    monkeypatch.setattr(launch, "run", fail)
    monkeypatch.setattr(cli, "_discard_output", lambda: None)  # keep pytest's streams
    assert cli.main(["--cpu", "--num_gpus", "1", __file__]) == 1
    assert capfd.readouterr().err.splitlines()[-1] == (
        "dsrun: error: cannot write to stdout: [Errno 28] No space left on device: the job "
        "was stopped (its output from there on is lost)")


class _Stalled(io.StringIO):
    def __init__(self) -> None:
        super().__init__()
        self.go = threading.Event()

    def write(self, text: str) -> int:
        self.go.wait()
        return super().write(text)


def test_after_a_signal_stopped_the_job_a_reader_is_waited_for_only_briefly(monkeypatch):
    monkeypatch.setattr(output_end, "SIGNALLED_OUTPUT_WAIT", 0.5)
    out, err = _Stalled(), io.StringIO()
    c = Console(out, err, tty=False)
    SIGNALS.reset()
    c.start_writer()
    try:
        c.lines("h", 0, 1, ["line 0"])  # the writer blocks in this write
        end = time.monotonic() + 5
        while not c._writers[1].busy and time.monotonic() < end:
            time.sleep(0.01)
        c.lines("h", 0, 1, [f"line {i}" for i in range(1, 100)])  # and these wait
        began = time.monotonic()
        output_end.finish_output(c, 60.0, stopped_by=signal.SIGTERM)
        assert time.monotonic() - began < 3
        c.close(wait=False)
    finally:
        out.go.set()
        SIGNALS.reset()
    assert err.getvalue().startswith(
        "dsrun: nothing was read from dsrun's stdout for 0.5s after SIGTERM stopped the job "
        "(dsrun then waits at most 0.5s for its reader): dropped ")


def test_a_stopped_rank_says_why_it_has_no_stack():
    assert stack_lines("h", 3, None, stopped=True) == [
        "[h:3] (no stack: the rank is stopped (SIGSTOP), not running; SIGCONT resumes it)"]
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert not stopped(child.pid)
        os.kill(child.pid, signal.SIGSTOP)
        end = time.monotonic() + 5
        while not stopped(child.pid) and time.monotonic() < end:
            time.sleep(0.01)
        assert stopped(child.pid)
    finally:
        child.kill()
        child.wait()


@pytest.mark.parametrize("flag", ["--tee", "--redirects"])
def test_torchruns_output_flags_point_to_log_dir(flag):
    exc = click.NoSuchOption(flag, possibilities=["--env"])
    text = cli_hints.message(exc)
    assert text.startswith(f"No such option '{flag}' (a torchrun flag).")
    assert "--log_dir DIR" in text and "--env" not in text


class _Fillable(io.StringIO):
    """A stream that fails with ENOSPC while ``full``."""

    full = True

    def write(self, text: str) -> int:
        if self.full:
            raise OSError(errno.ENOSPC, "No space left on device")
        return super().write(text)


def test_a_failed_or_dropped_stream_does_not_carry_over_to_the_next_jobs_output():
    out, err = _Fillable(), io.StringIO()
    c = Console(out=out, err=err, tty=False)
    c.start_writer()
    c.line("h", 0, 1, "first job")
    assert c.written(10)
    c.drop(2)
    assert c.close() is True and c.failure is not None
    out.full = False
    c.start_writer()  # the next launch.run in this process
    c.line("h", 0, 1, "second job")
    c.say("second job's message")
    assert c.pending() >= 0
    assert c.close() is False and c.failure is None
    assert out.getvalue() == "[h:0] second job\n"
    assert err.getvalue() == "dsrun: second job's message\n"


STACK_INTO_A_FULL_DISK = """\
import sys
from dsrun.launcher import cli, control
control.running_jobs = lambda: [{"job_id": "abcdef1234567890", "socket": "x"}]
control.choose_job = lambda jobs, job: jobs[0]
def stream(path, write, timeout=30.0, note=None):
    for i in range(3):
        write(f"[h:{i}] stack line")
    return 3, True
control.stream_stacks = stream
sys.exit(cli.main(["stack"]))
"""


def test_dsrun_stack_says_its_stdout_failed_not_the_job():
    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full here")
    with open("/dev/full", "w") as full:
        res = subprocess.run([sys.executable, "-c", STACK_INTO_A_FULL_DISK], stdout=full,
                             stderr=subprocess.PIPE, text=True, cwd=str(ROOT), timeout=60)
    assert res.returncode == 1, res.stderr
    assert res.stderr == \
        "dsrun: error: cannot write to stdout: [Errno 28] No space left on device\n"
