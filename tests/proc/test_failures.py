"""Real processes: failures, signals and teardown of a local job.

Workers run with --dist_backend none (no torch import) unless a test is
about the process group, so each test costs well under a second of CPU.
Every test checks that no process of the job is left.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time

import psutil
import pytest

from tests.conftest import (
    ROOT,
    WORKERS,
    descendants,
    dsrun_argv,
    run_dsrun,
    start_dsrun,
    wait_for_pids,
    wait_gone,
)

pytestmark = pytest.mark.proc
BEHAVE = str(WORKERS / "behave.py")


def _behave(*extra: str, n: int = 2, grace: float = 1.0) -> list[str]:
    return ["--cpu", "--num_gpus", str(n), "--dist_backend", "none", "--kill_grace", str(grace),
            BEHAVE, *extra]


def test_exit_code_of_failing_rank_is_propagated_and_named(pid_dir):
    start = time.monotonic()
    res = run_dsrun(*_behave("--pid_dir", str(pid_dir), "--fail_rank", "1", "--code", "3"))
    elapsed = time.monotonic() - start
    assert res.returncode == 3, res.stderr
    assert elapsed < 20  # not rank 0's 60 s sleep
    assert "rank 1 on host" in res.stderr and "failed first: exit code 3" in res.stderr
    assert "rank 1 exiting with 3" in res.stderr  # the output tail is in the report
    assert wait_gone(list(wait_for_pids(pid_dir, 2, 1).values()), 2) == []


def test_segfault_reports_the_signal(pid_dir):
    res = run_dsrun(*_behave("--pid_dir", str(pid_dir), "--segv_rank", "0"))
    assert res.returncode == 128 + signal.SIGSEGV, res.stderr
    assert "rank 0 on host" in res.stderr and "killed by signal SIGSEGV" in res.stderr
    assert wait_gone(list(wait_for_pids(pid_dir, 2, 1).values()), 2) == []


@pytest.mark.parametrize("how,code", [("exit", 3), ("segv", 128 + signal.SIGSEGV),
                                      ("kill", 128 + signal.SIGKILL)])
def test_a_rank_dying_without_a_traceback_is_blamed_not_the_peer_it_reset(pid_dir, how, code):
    """rank 0, inside a gloo all_reduce with rank 1, gets
    "Connection closed by peer" when rank 1 dies; its record is stamped
    when gloo raised, rank 1's death only when its agent woke up to it, so
    rank 0 was often blamed (exit 1)."""
    res = run_dsrun("--cpu", "--num_gpus", "2", "--kill_grace", "1",
                    str(WORKERS / "peer_death.py"), "--how", how, "--pid_dir", str(pid_dir),
                    timeout=90)
    assert res.returncode == code, res.stderr
    assert "job failed: rank 1 on host" in res.stderr, res.stderr
    assert "1 other rank(s) " in res.stderr and "as a consequence" in res.stderr
    assert wait_gone(list(wait_for_pids(pid_dir, 2, 1).values()), 2) == []


def test_python_exception_traceback_in_report(pid_dir):
    res = run_dsrun(*_behave("--pid_dir", str(pid_dir), "--raise_rank", "1"))
    assert res.returncode == 1
    report = res.stderr[res.stderr.index("job failed"):]
    assert "rank 1 on host" in report
    assert "ValueError: deliberate failure on rank 1" in report
    assert "behave.py" in report and "bootstrap.py" not in report
    assert wait_gone(list(wait_for_pids(pid_dir, 2, 1).values()), 2) == []


def test_rank_ignoring_sigterm_is_killed_after_grace(pid_dir):
    start = time.monotonic()
    res = run_dsrun(*_behave("--pid_dir", str(pid_dir), "--fail_rank", "0", "--code", "5",
                             "--ignore_term_rank", "1", grace=1.5))
    elapsed = time.monotonic() - start
    assert res.returncode == 5, res.stderr
    assert 1.5 <= elapsed < 20, elapsed  # SIGKILLed, not waited for (60 s sleep)
    assert "rank 0 on host" in res.stderr  # root cause is not the SIGKILLed rank 1
    assert wait_gone(list(wait_for_pids(pid_dir, 2, 1).values()), 1) == []


@pytest.mark.parametrize("how", ["group", "setsid"])
def test_grandchild_ignoring_sigterm_is_gone(pid_dir, how):
    res = run_dsrun(*_behave("--pid_dir", str(pid_dir), "--fail_rank", "1",
                             "--grandchild", how, "--delay", "0.5"))
    assert res.returncode == 3, res.stderr
    pids = wait_for_pids(pid_dir, 4, 1)
    assert {"grandchild_0.pid", "grandchild_1.pid"} <= set(pids)
    assert wait_gone(list(pids.values()), 2) == []


def test_leftover_background_process_after_success_is_stopped(pid_dir):
    res = run_dsrun(*_behave("--pid_dir", str(pid_dir), "--grandchild", "setsid",
                             "--sleep", "0.2"))
    assert res.returncode == 0, res.stderr
    assert wait_gone(list(wait_for_pids(pid_dir, 4, 1).values()), 2) == []


@pytest.mark.parametrize("sig,code", [(signal.SIGINT, 130), (signal.SIGTERM, 143),
                                      (signal.SIGHUP, 129)])
def test_signal_to_dsrun_stops_everything(pid_dir, sig, code):
    proc = start_dsrun(*_behave("--pid_dir", str(pid_dir), "--grandchild", "group"))
    try:
        pids = wait_for_pids(pid_dir, 4)
        job = set(pids.values()) | set(descendants(proc.pid))
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=15)
    finally:
        proc.kill()
    assert proc.returncode == code, err
    assert f"stopped by {signal.Signals(sig).name}" in err
    assert wait_gone(sorted(job), 2) == []


def test_a_burst_of_signals_while_the_job_stops_ends_in_one_clean_exit(pid_dir):
    """Ctrl-C pressed again and again (or ``timeout`` signalling dsrun and its
    group): the signals that land while the stop is being sent are taken as
    the second signal, never as a traceback."""
    proc = start_dsrun(*_behave("--pid_dir", str(pid_dir), "--ignore_term_rank", "1",
                                grace=30.0))
    try:
        pids = wait_for_pids(pid_dir, 2)
        job = set(pids.values()) | set(descendants(proc.pid))
        for _ in range(20):
            proc.send_signal(signal.SIGINT)
            time.sleep(0.002)
        out, err = proc.communicate(timeout=15)
    finally:
        proc.kill()
    assert proc.returncode == 130, err
    own = [line for line in err.splitlines() if not line.startswith("[")]  # not the ranks'
    assert not any("Traceback" in line for line in own), err
    assert "stopped by SIGINT; every rank was stopped" in err
    assert wait_gone(sorted(job), 2) == []


def test_signals_that_keep_coming_until_dsrun_exits_never_kill_it(pid_dir):
    """A burst that outlasts the job's stop (Ctrl-C held down): signals that
    land after the job ended, while dsrun exits, are absorbed too - dsrun's
    status stays 130, never death by SIGINT from a handler put back too
    early."""
    proc = start_dsrun(*_behave("--pid_dir", str(pid_dir)))
    try:
        wait_for_pids(pid_dir, 2)
        sent = 0
        while proc.poll() is None and sent < 5000:
            proc.send_signal(signal.SIGINT)
            sent += 1
            time.sleep(0.001)
        out, err = proc.communicate(timeout=15)
    finally:
        proc.kill()
    assert proc.returncode == 130, (proc.returncode, err)
    assert "stopped by SIGINT" in err


@pytest.mark.parametrize("sig", [signal.SIGHUP, signal.SIGINT])
def test_a_signal_ignored_at_start_stays_ignored(pid_dir, sig):
    """``nohup dsrun ...`` (SIGHUP ignored) and a non-interactive shell's
    ``dsrun ... &`` (SIGINT ignored): the job outlives that signal."""
    argv = dsrun_argv(*_behave("--pid_dir", str(pid_dir), "--sleep", "2"))
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=str(ROOT), preexec_fn=lambda: signal.signal(sig, signal.SIG_IGN))
    try:
        wait_for_pids(pid_dir, 2)
        time.sleep(0.3)  # the ranks are up: dsrun's handlers are in place
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=15)
    finally:
        proc.kill()
    assert proc.returncode == 0, err
    assert "stopped by" not in err


def test_sigkill_to_agent_kills_its_ranks(pid_dir):
    proc = start_dsrun(*_behave("--pid_dir", str(pid_dir), "--grandchild", "setsid"))
    try:
        pids = wait_for_pids(pid_dir, 4)
        agents = [c for c in psutil.Process(proc.pid).children()
                  if "dsrun.launcher.agent" in " ".join(c.cmdline())]
        assert len(agents) == 1
        job = set(pids.values()) | set(descendants(agents[0].pid))
        agents[0].kill()
        assert wait_gone(sorted(job), 3) == []
        out, err = proc.communicate(timeout=10)
    finally:
        proc.kill()
    assert proc.returncode == 128 + signal.SIGKILL, err
    assert "killed by SIGKILL" in err and "the node agent on host" in err


@pytest.mark.parametrize("twice", [False, True], ids=["once", "twice"])
def test_a_signal_to_an_agent_is_blamed_on_the_agent_not_a_rank(pid_dir, tmp_path, twice):
    """SIGTERM to a node agent (an admin, a scheduler, orted): the job is
    stopped by that signal (an interruption, not a failure of the rank it
    stopped first), and dsrun says the agent got it. A second one hurries
    the stop past a rank ignoring SIGTERM and a long grace."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    extra = ("--ignore_term_rank", "1") if twice else ()
    argv = _behave("--pid_dir", str(pid_dir), *extra, grace=20.0 if twice else 1.0)
    proc = start_dsrun(*argv, env={"TMPDIR": str(tmp)})
    try:
        pids = wait_for_pids(pid_dir, 2)
        time.sleep(0.3)  # the ranks are up: their signal dispositions are set
        agents = [c for c in psutil.Process(proc.pid).children()
                  if "dsrun.launcher.agent" in " ".join(c.cmdline())]
        assert len(agents) == 1
        job = set(pids.values()) | set(descendants(agents[0].pid)) | {agents[0].pid}
        start = time.monotonic()
        agents[0].terminate()
        if twice:
            time.sleep(1.2)  # not the same delivery again (agent_os.REPEAT)
            agents[0].terminate()
        out, err = proc.communicate(timeout=15)
        took = time.monotonic() - start
    finally:
        proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert (f"the node agent on host {os.uname().nodename} got SIGTERM (not from dsrun, which "
            f"got none): it stopped its ranks, and dsrun stopped the job") in err, err
    assert "stopped by SIGTERM; every rank was stopped" in err, err
    assert "job failed" not in err and "failed first" not in err, err
    assert took < 10, took  # not the 20 s grace
    assert wait_gone(sorted(job), 2) == []
    control = f"dsrun-{os.getuid()}"  # the launcher's control sockets' directory
    assert [p.name for p in tmp.iterdir() if p.name != control] == []  # the agent's is gone


def test_max_restarts_recovers_from_one_failure(pid_dir):
    res = run_dsrun("--max_restarts", "1", *_behave("--flaky"))
    assert res.returncode == 0, res.stderr
    assert "restarting (1/1)" in res.stderr
    assert "rank 1 attempt 0" in res.stdout and "rank 1 attempt 1" in res.stdout


def test_max_restarts_exhausted_reports_last_failure():
    res = run_dsrun("--max_restarts", "1", *_behave("--fail_rank", "0", "--code", "7",
                                                    "--delay", "0"))
    assert res.returncode == 7
    assert res.stderr.count("restarting") == 1


def test_log_dir_gets_one_file_per_rank(tmp_path):
    logs = tmp_path / "logs"
    res = run_dsrun("--log_dir", str(logs), *_behave("--sleep", "0", n=3))
    assert res.returncode == 0, res.stderr
    for rank in range(3):
        text = (logs / f"rank_{rank}.log").read_text()
        assert f"rank {rank} up" in text
    assert "[" in res.stdout and "] rank 2 up" in res.stdout


@pytest.mark.parametrize("flag,spelling", [("--local_rank_arg", "--local_rank"),
                                           ("--local-rank-arg", "--local-rank")])
def test_local_rank_argument_for_deepspeed_style_scripts(tmp_path, flag, spelling):
    script = tmp_path / "ds_style.py"
    script.write_text(
        "import argparse, os, sys\n"
        "p = argparse.ArgumentParser()\n"
        "p.add_argument('--local_rank', '--local-rank', type=int, required=True)\n"
        "p.add_argument('--lr')\n"
        "a = p.parse_args()\n"
        "assert a.local_rank == int(os.environ['LOCAL_RANK'])\n"
        "print('argv', sys.argv[1:], flush=True)\n")
    res = run_dsrun("--cpu", "--num_gpus", "2", "--dist_backend", "none", flag, str(script),
                    "--lr", "0.1")
    assert res.returncode == 0, res.stderr
    assert f"argv ['{spelling}=1', '--lr', '0.1']" in res.stdout
    assert f"argv ['{spelling}=0', '--lr', '0.1']" in res.stdout


@pytest.mark.parametrize("extra,expected", [((), "{lr}"), (("--no_local_rank",), "-1")])
def test_deepspeed_scripts_get_their_local_rank_without_a_flag(extra, expected):
    res = run_dsrun("--cpu", "--num_gpus", "2", "--dist_backend", "none", *extra,
                    str(WORKERS / "ds_local_rank.py"), "--epochs", "3")
    assert res.returncode == 0, res.stderr
    for lr in (0, 1):
        assert f"local_rank {expected.format(lr=lr)} env {lr} epochs 3" in res.stdout, res.stdout


def test_start_banner_names_the_hostfile(tmp_path):
    (tmp_path / "hostfile").write_text("localhost slots=1\n")
    res = run_dsrun("--cpu", "--dist_backend", "none", str(WORKERS / "hang.py"), "--finish",
                    "0", cwd=str(tmp_path))
    assert res.returncode == 0, res.stderr
    assert res.stderr.splitlines()[0].startswith(
        f"dsrun: hostfile: {tmp_path / 'hostfile'} (found in the working directory")


def test_a_launch_tools_failure_quotes_its_cause_after_a_long_help_block():
    """Open MPI prints the ssh error, then a help block longer than the kept
    tail: the summary still quotes the ssh line (a real process standing in
    for mpirun, so no MPI is needed)."""
    from dsrun.launcher.backends.connect import TOOL_TAIL, LaunchTool

    block = "\n".join(["-" * 70, "ORTE was unable to reliably start one or more daemons.",
                       *[f"help text line {i}" for i in range(TOOL_TAIL + 5)], "-" * 70])
    script = ("echo 'ssh: Could not resolve hostname nosuch: Name or service not known' >&2\n"
              f"cat <<'EOF'\n{block}\nEOF\nexit 255\n")
    lines: list[str] = []
    tool = LaunchTool("mpirun", ["sh", "-c", script], dict(os.environ), str(ROOT),
                      lambda name, kind, fd, line: lines.append(line))
    tool.proc.wait(timeout=30)
    text = tool.exit_text(" before the agents connected back")
    assert text == ("mpirun exited with status 255 before the agents connected back: "
                    "ssh: Could not resolve hostname nosuch: Name or service not known")
    assert len(lines) > TOOL_TAIL + 5  # every line was forwarded


_CLEANS_UP = (
    "import os, sys, time\n"
    "rank = os.environ['RANK']\n"
    "out = sys.argv[1]\n"
    "open(os.path.join(out, 'rank_' + rank + '.pid'), 'w').write(str(os.getpid()))\n"
    "try:\n"
    "    time.sleep(60)\n"
    "except KeyboardInterrupt:\n"
    "    open(os.path.join(out, 'interrupted_' + rank), 'w').close()\n"
    "    raise\n"
    "finally:\n"
    "    open(os.path.join(out, 'finally_' + rank), 'w').close()\n")


@pytest.mark.parametrize("sig,cleaned", [(signal.SIGINT, True), (signal.SIGTERM, False)])
def test_ctrl_c_reaches_the_ranks_as_sigint_so_their_cleanup_runs(tmp_path, pid_dir, sig,
                                                                  cleaned):
    """A Ctrl-C of dsrun is a Ctrl-C of every rank (SIGINT, as a terminal
    gives plain python and torchrun passes on): ``except KeyboardInterrupt``
    and ``finally`` run. SIGTERM to dsrun stays SIGTERM to the ranks."""
    script = tmp_path / "cleanup.py"
    script.write_text(_CLEANS_UP)
    proc = start_dsrun("--cpu", "--num_gpus", "2", "--dist_backend", "none", "--kill_grace",
                       "10", str(script), str(pid_dir))
    try:
        pids = wait_for_pids(pid_dir, 2)
        time.sleep(0.3)  # dsrun's handlers are in place once the ranks run
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 128 + sig, err
    assert wait_gone(sorted(pids.values()), 2) == []
    marks = sorted(p.name for p in pid_dir.iterdir() if not p.name.endswith(".pid"))
    assert marks == (["finally_0", "finally_1", "interrupted_0", "interrupted_1"]
                     if cleaned else []), err
