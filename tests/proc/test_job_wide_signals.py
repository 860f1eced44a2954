"""Real processes: signals sent to every process of a job, SIGUSR1/SIGUSR2,
and ranks that ignore a signal dsrun relies on.

Slurm's time limit, a preemption or ``scancel`` signal every process of the
job step within milliseconds, in any order: dsrun, its node agent, the
agent's guard and the ranks. The ranks run tests/proc/workers/signal_saver.py
(no torch), whose handler "saves" for a second and writes a marker file.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import time
from pathlib import Path

import psutil
import pytest

from tests.conftest import WORKERS, descendants, run_dsrun, start_dsrun, wait_for_pids, wait_gone

pytestmark = pytest.mark.proc
SAVER = str(WORKERS / "signal_saver.py")


def _start(pid_dir: Path, out: Path, *extra: str, grace: float = 10.0, env=None):
    return start_dsrun("--cpu", "--num_gpus", "2", "--dist_backend", "none", "--kill_grace",
                       str(grace), SAVER, "--pid_dir", str(pid_dir), "--out", str(out), *extra,
                       env=env)


def _job(proc, pid_dir: Path) -> list[int]:
    """The launcher, its agent, the agent's guard and the ranks, once up."""
    wait_for_pids(pid_dir, 2)
    time.sleep(0.3)  # the ranks' handlers are in place
    job = [proc.pid, *descendants(proc.pid)]
    assert len(job) >= 5, job  # launcher, agent, guard, 2 ranks
    return job


def _signal_everyone(job: list[int], sig: int, launcher_after: float,
                     agent_again: bool = False) -> None:
    """``sig`` to every process of the job, the launcher ``launcher_after``
    seconds after the others (it was the order that lost the saves);
    ``agent_again``: the agent gets a second copy 0.1 s later, as srun
    passes on to its tasks the signal Slurm sent to the whole job."""
    agent = next(p for p in job[1:] if psutil.Process(p).ppid() == job[0])
    for pid in job[1:]:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass
    if agent_again:
        time.sleep(0.1)
        os.kill(agent, sig)
    time.sleep(launcher_after)
    os.kill(job[0], sig)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["TERM", "INT"])
@pytest.mark.parametrize("launcher_after,agent_again", [(0.0, False), (0.3, False),
                                                        (0.0, True)],
                         ids=["together", "agent_first", "agent_twice"])
def test_a_signal_to_every_process_gives_the_ranks_their_grace(pid_dir, tmp_path, sig,
                                                              launcher_after, agent_again):
    """The ranks' save-on-signal completes, the report is an interruption
    (not "job failed"), the exit status is 128+N, nothing is left. The old
    code took the agent's own signal for a failure, and the launcher's own
    signal then "hurried" it: every rank was SIGKILLed mid-save. The same
    signal again to an agent within a second is the same delivery."""
    out = tmp_path / "out"
    out.mkdir()
    proc = _start(pid_dir, out, "--stop", sig.name)
    try:
        job = _job(proc, pid_dir)
        _signal_everyone(job, sig, launcher_after, agent_again)
        _, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 128 + sig, err
    assert f"stopped by {sig.name}; every rank was stopped" in err, err
    assert "job failed" not in err and "SIGKILL" not in err, err
    assert sorted(p.name for p in out.iterdir()) == ["saved_0", "saved_1"], err
    assert wait_gone(job, 5) == []


def test_sigusr1_to_dsrun_reaches_the_ranks_and_the_job_goes_on(pid_dir, tmp_path):
    """``kill -USR1 $LAUNCHER_PID`` (a Slurm batch script's trap): each
    rank's handler runs once, and the job ends by itself with status 0.
    The old code died of SIGUSR1 (status -10) without a word."""
    out = tmp_path / "out"
    out.mkdir()
    proc = _start(pid_dir, out, "--usr", "--until_usr")
    try:
        job = _job(proc, pid_dir)
        os.kill(proc.pid, signal.SIGUSR1)
        _, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 0, err
    assert "SIGUSR1: forwarded to every rank's process group" in err
    for rank in (0, 1):
        assert (out / f"usr_{rank}").read_text() == "SIGUSR1\n", err
    assert wait_gone(job, 5) == []


def test_sigusr1_to_every_process_keeps_the_agent_and_reaches_each_rank_once(pid_dir,
                                                                             tmp_path):
    """A USR1 sent to the whole job: the agent and its guard live on (the old
    agent died of it, and its ranks with it, before their handler ran), and
    each rank's handler runs once - the agent does not add a copy of its own."""
    out = tmp_path / "out"
    out.mkdir()
    proc = _start(pid_dir, out, "--usr", "--until_usr")
    try:
        job = _job(proc, pid_dir)
        _signal_everyone(job, signal.SIGUSR1, 0.0)
        _, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 0, err
    assert "failed" not in err, err
    for rank in (0, 1):
        assert (out / f"usr_{rank}").read_text() == "SIGUSR1\n", err
    assert wait_gone(job, 5) == []


@pytest.mark.parametrize("how,said", [
    ("ignore", "(no stack: rank {} ignores SIGRTMIN+4, dsrun's stack signal"),
    ("block", "(no stack: rank {} blocks SIGRTMIN+4, dsrun's stack signal"),
    ("handle", "(no answer: rank {} did not write its stack within 2s; likely a handler of "
               "the script's own for SIGRTMIN+4, dsrun's stack signal")])
def test_dsrun_stack_names_a_rank_that_ignores_or_blocks_the_stack_signal(pid_dir, tmp_path,
                                                                        how, said):
    """It used to say only "no answer: the rank did not write its stack in
    time" (and wait for it), whatever the rank did with the signal."""
    run_dir = tmp_path / "run"
    run_dir.mkdir(mode=0o700)
    env = {"XDG_RUNTIME_DIR": str(run_dir)}
    out = tmp_path / "out"
    out.mkdir()
    proc = _start(pid_dir, out, "--stack", how, grace=1.0, env=env)
    try:
        job = _job(proc, pid_dir)
        res = run_dsrun("stack", env=env, timeout=30)
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=30)
    finally:
        proc.kill()
    for rank in (0, 1):
        assert f":{rank}] " in res.stdout and said.format(rank) in res.stdout, \
            res.stdout + res.stderr
    assert wait_gone(job, 5) == []


def test_ctrl_c_gives_sigterm_to_a_rank_that_ignores_sigint(pid_dir, tmp_path):
    """A rank with SIGINT ignored and a SIGTERM-only preemption handler: on
    Ctrl-C it gets SIGTERM, as the job's processes outside the ranks' groups
    do, and its save completes (it used to sit out --kill_grace, then die
    of SIGKILL)."""
    out = tmp_path / "out"
    out.mkdir()
    proc = _start(pid_dir, out, "--ignore_int", "--stop", "SIGTERM", "--save", "0.2")
    try:
        job = _job(proc, pid_dir)
        start = time.monotonic()
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)
        took = time.monotonic() - start
    finally:
        proc.kill()
    assert proc.returncode == 130, err
    assert "stopped by SIGINT; every rank was stopped" in err and "SIGKILL" not in err, err
    assert [(out / f"saved_{r}").read_text() for r in (0, 1)] == ["SIGTERM"] * 2
    assert took < 8, took  # not the 10 s grace
    assert wait_gone(job, 5) == []


@pytest.mark.parametrize("agent_after", [0.0, 0.05], ids=["together", "50ms"])
def test_handler_less_ranks_killed_by_a_signal_dsrun_did_not_get_are_no_failure(
        pid_dir, tmp_path, agent_after):
    """Ranks without a handler die of SIGTERM at once, often before their
    agent's own handler has run, and dsrun got no copy (``scancel`` of the
    steps only, a signal to the steps' cgroup). Still ``stopped by
    SIGTERM``, and --max_restarts does not start another attempt. The ranks
    are signalled first, the agent ``agent_after`` seconds later (it waits
    agent.LINGER for its own copy): the old code took the rank whose exit it
    saw first for the cause and restarted the job (about one run in three
    when all were signalled together in any order)."""
    for attempt in range(2):  # the race is timing-dependent: twice each
        pids, out = tmp_path / f"pids{attempt}", tmp_path / f"out{attempt}"
        pids.mkdir()
        out.mkdir()
        proc = start_dsrun("--cpu", "--num_gpus", "2", "--dist_backend", "none",
                           "--max_restarts", "1", SAVER, "--pid_dir", str(pids),
                           "--out", str(out), "--run", "20")
        try:
            ranks = sorted(wait_for_pids(pids, 2).values())
            time.sleep(0.3)
            job = [proc.pid, *descendants(proc.pid)]
            for pid in ranks:
                os.kill(pid, signal.SIGTERM)
            time.sleep(agent_after)
            agent = next(p for p in job[1:] if psutil.Process(p).ppid() == proc.pid)
            with contextlib.suppress(ProcessLookupError):  # the old agent: gone by then
                os.kill(agent, signal.SIGTERM)
            for pid in set(job[1:]) - {agent, *ranks}:  # its guard, if still there
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGTERM)
            _, err = proc.communicate(timeout=15)  # a restart runs 20 s
        finally:
            proc.kill()
        assert proc.returncode == 128 + signal.SIGTERM, err
        assert "stopped by SIGTERM; every rank was stopped" in err, err
        assert "job failed" not in err and "restarting" not in err, err
        assert "the node agent on host" in err and "dsrun, which got none" in err, err
        assert wait_gone(job, 5) == []


def test_a_failure_s_stop_gives_the_survivors_failure_grace_not_kill_grace(pid_dir):
    """Rank 0 fails; rank 1 ignores SIGTERM (as one blocked in a collective
    with the dead rank, where no handler runs): it is SIGKILLed after
    agent_stop.FAILURE_GRACE (5 s), not --kill_grace 30 - which the old code
    waited out before the report (and before any --max_restarts restart)."""
    start = time.monotonic()
    res = run_dsrun("--cpu", "--num_gpus", "2", "--dist_backend", "none", "--kill_grace", "30",
                    str(WORKERS / "behave.py"), "--pid_dir", str(pid_dir), "--fail_rank", "0",
                    "--ignore_term_rank", "1", timeout=60)
    took = time.monotonic() - start
    assert res.returncode == 3, res.stderr
    assert "rank 0 on host" in res.stderr and "failed first" in res.stderr, res.stderr
    assert "rank 1 on host vm still running 5s after SIGTERM: killed with SIGKILL" \
        in res.stderr.replace(socket.gethostname(), "vm"), res.stderr
    assert took < 15, took


def test_a_copy_of_dsrun_s_sigterm_is_no_second_signal(pid_dir, tmp_path):
    """A batch script's ``trap 'kill -TERM $pid' TERM`` passes on the SIGTERM
    Slurm sent dsrun as well, milliseconds later: one delivery, the ranks
    save within their grace. The old code took the copy for a second
    signal and SIGKILLed every rank mid-save."""
    out = tmp_path / "out"
    out.mkdir()
    proc = _start(pid_dir, out, "--stop", "SIGTERM", "--save", "0.5")
    try:
        job = _job(proc, pid_dir)
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.01)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert "stopped by SIGTERM; every rank was stopped" in err and "SIGKILL" not in err, err
    assert sorted(p.name for p in out.iterdir()) == ["saved_0", "saved_1"], err
    assert wait_gone(job, 5) == []
