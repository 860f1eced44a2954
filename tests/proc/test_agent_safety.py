"""The node agent's own safety: teardown touches only the job, spawning stops
at the first failure, no Python code between fork and exec, ranks die with
the agent. Real processes; the pid-reuse case runs in a PID namespace of
its own (root)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import psutil
import pytest

from dsrun.launcher import agent as agent_mod
from dsrun.launcher import procs
from tests.conftest import ROOT, WORKERS, alive, run_agent, start_dsrun, wait_for_pids, wait_gone


def _stand_in() -> subprocess.Popen:
    """Someone else's process, leading a group of its own."""
    return subprocess.Popen(["sleep", "60"], start_new_session=True)


def test_teardown_spares_a_group_whose_leader_pid_was_reused(tmp_path):
    stand_in = _stand_in()
    try:
        real = procs.Leader.of(stand_in.pid)
        assert real is not None
        # what the agent remembered of a rank that had this pid earlier
        stale = procs.Leader(stand_in.pid, real.started - 100.0)
        assert not stale.ours() and real.ours()
        assert procs.job_processes([stale], "no-such-marker") == []
        procs.signal_job([stale], "no-such-marker", signal.SIGTERM)
        assert procs.stop_job([stale], "no-such-marker", grace=0.2) == 0
        procs.kill_job([stale], "no-such-marker")
        time.sleep(0.2)
        assert stand_in.poll() is None, "a process that was never the job's was signalled"
        # the same group, remembered correctly, is the job's
        assert stand_in.pid in [p.pid for p in procs.job_processes([real], None)]
    finally:
        stand_in.kill()
        stand_in.wait()


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None,
                    reason="a PID namespace of its own needs root and unshare")
def test_rank_pid_reused_by_another_process_survives_the_job_teardown(tmp_path):
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()
    res = subprocess.run(
        ["unshare", "--pid", "--fork", "--mount-proc", sys.executable,
         str(WORKERS / "reuse_pid.py"), str(pid_dir), str(tmp_path / "go")],
        capture_output=True, text=True, timeout=120, cwd=str(ROOT))
    assert res.returncode == 0, res.stderr
    outcome = json.loads(res.stdout.strip().splitlines()[-1])
    assert outcome["job_rc"] == 3, res.stderr
    assert outcome["survived"], f"the stand-in (pid reused: {outcome['reused']}) was killed"


def _agent(payload: dict, timeout: float = 30) -> list[dict]:
    return run_agent(payload, timeout)[0]


def _rank(rank: int, argv: list[str]) -> dict:
    return {"rank": rank, "local_rank": rank, "argv": argv, "runtime": True,
            "env": {"dsrun": {"RANK": str(rank)}, "defaults": {}, "path_prepend": []}}


def test_spawning_stops_at_the_first_rank_that_cannot_start(tmp_path):
    flag = tmp_path / "rank1_ran"
    payload = {"job_id": "a" * 32, "kill_grace": 1, "cwd": str(tmp_path), "env": {},
               "ranks": [_rank(0, [str(tmp_path / "no-such-program")]),
                         _rank(1, [sys.executable, "-c",
                                   f"open({str(flag)!r}, 'w'); import time; time.sleep(30)"])]}
    events = _agent(payload)
    exits = [e for e in events if e.get("ev") == "exit"]
    assert [(e["rank"], e["code"]) for e in exits] == [(0, 127)]
    assert "cannot start" in exits[0]["error"]["message"]
    assert not [e for e in events if e.get("ev") == "started"], events
    assert events[-1]["ev"] == "done"
    time.sleep(0.5)
    assert not flag.exists(), "rank 1 was started after rank 0 could not be"


def test_agent_spawns_ranks_without_preexec_fn(monkeypatch, tmp_path):
    from dsrun.launcher.link import Link

    seen: list[dict] = []

    class FakePopen:
        def __init__(self, argv, **kwargs):
            seen.append({"argv": argv, **kwargs})
            self.pid = os.getpid()

    monkeypatch.setattr(agent_mod.subprocess, "Popen", FakePopen)
    read, write = os.pipe()
    link = Link(read, os.fdopen(write, "wb"))
    payload = {"job_id": "b" * 32, "ranks": []}
    agent = agent_mod.Agent(payload, link, guard=None)
    try:
        agent._spawn(_rank(0, [sys.executable, "-c", "pass"]))
        no_python = {**_rank(1, ["sleep", "1"]), "runtime": False}
        agent._spawn(no_python)
    finally:
        shutil.rmtree(agent.tmpdir, ignore_errors=True)
        os.close(read)
    assert len(seen) == 2
    for call in seen:
        assert call.get("preexec_fn") is None and call["start_new_session"] is True
        assert call["env"]["DSRUN_AGENT_PID"] == str(os.getpid())
    # a rank without the injected runtime arms its parent-death signal in a wrapper
    assert seen[1]["argv"][:3] == [sys.executable, "-I", "-S"]
    assert seen[1]["argv"][3].endswith("deathsig.py")
    assert seen[1]["argv"][4:] == [str(os.getpid()), "--", "sleep", "1"]


@pytest.mark.parametrize("mode", ["runtime", "no_python"])
def test_ranks_die_with_a_sigkilled_agent(tmp_path, pid_dir, mode):
    if mode == "runtime":
        args = ["--dist_backend", "none", str(WORKERS / "hang.py"), "--pid_dir", str(pid_dir),
                "--finish", "none"]
    else:
        script = tmp_path / "rank.sh"
        script.write_text(f"#!/bin/sh\necho $$ > {pid_dir}/rank_$RANK.pid\nexec sleep 60\n")
        script.chmod(0o755)
        args = ["--no_python", str(script)]
    proc = start_dsrun("--cpu", "--num_gpus", "2", "--kill_grace", "1", *args)
    try:
        pids = wait_for_pids(pid_dir, 2)
        agents = [c for c in psutil.Process(proc.pid).children()
                  if "dsrun.launcher.agent" in " ".join(c.cmdline())]
        assert len(agents) == 1
        for pid in pids.values():  # the parent-death signal is armed in each rank
            assert psutil.Process(pid).ppid() == agents[0].pid
        # the agent's temporary directory (the ranks' error and stack files)
        error_file = psutil.Process(next(iter(pids.values()))).environ()["DSRUN_ERROR_FILE"]
        tmpdir = os.path.dirname(error_file)
        assert os.path.isdir(tmpdir)
        agents[0].kill()
        assert wait_gone(list(pids.values()), 3) == []
        proc.communicate(timeout=20)
        deadline = time.monotonic() + 3
        while os.path.exists(tmpdir) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not os.path.exists(tmpdir), "the guard left the agent's temporary directory"
    finally:
        proc.kill()


def test_guard_is_forked_and_named(pid_dir):
    proc = start_dsrun("--cpu", "--num_gpus", "1", "--dist_backend", "none",
                       str(WORKERS / "hang.py"), "--pid_dir", str(pid_dir), "--finish", "none")
    try:
        wait_for_pids(pid_dir, 1)
        agent = next(c for c in psutil.Process(proc.pid).children()
                     if "dsrun.launcher.agent" in " ".join(c.cmdline()))
        guards = [c for c in agent.children() if c.name() == "dsrun-guard"]
        assert len(guards) == 1 and guards[0].pid != agent.pid
        proc.send_signal(signal.SIGINT)
        proc.communicate(timeout=20)
        assert wait_gone([guards[0].pid], 3) == []  # told "done": it exits without killing
    finally:
        proc.kill()


def test_an_exited_rank_is_unreaped_until_teardown(pid_dir):
    """An exited rank stays a zombie of its agent while the job runs, so its
    pid (and group id) cannot be given to another process meanwhile."""
    proc = start_dsrun("--cpu", "--num_gpus", "2", "--dist_backend", "none",
                       str(WORKERS / "hang.py"), "--pid_dir", str(pid_dir), "--finish", "0")
    try:
        pids = wait_for_pids(pid_dir, 2)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and alive(pids["rank_0.pid"]):
            time.sleep(0.05)
        assert psutil.Process(pids["rank_0.pid"]).status() == psutil.STATUS_ZOMBIE
        proc.send_signal(signal.SIGINT)
        proc.communicate(timeout=20)
    finally:
        proc.kill()



def _up_line(event: dict) -> str | None:
    """The first line of an ``out`` event starting with "up" (a batch may
    hold more lines after it)."""
    return next((line for line in event.get("lines", ()) if line.startswith("up")), None)


def _start_agent(payload: dict, stderr: object = None
                 ) -> tuple[subprocess.Popen, list[dict]]:
    """A node agent fed ``payload``, and its events up to its rank's first
    line starting with "up" (the rank is running)."""
    proc = subprocess.Popen([sys.executable, "-m", "dsrun.launcher.agent"], cwd=str(ROOT),
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=stderr)
    assert proc.stdin is not None and proc.stdout is not None
    events: list[dict] = []
    try:
        proc.stdin.write((json.dumps(payload) + "\n").encode())
        proc.stdin.flush()
        for line in proc.stdout:
            events.append(json.loads(line))
            if _up_line(events[-1]) is not None:
                break
    except BaseException:
        proc.kill()  # the agent stops its ranks when its input ends
        proc.wait()
        raise
    return proc, events


_IGNORES_TERM = ("import signal, sys, time\n"
                 "signal.signal(signal.SIGTERM, lambda *a: print('TERM', flush=True))\n"
                 "print('up', flush=True)\n"
                 "time.sleep(60)\n")


@pytest.mark.parametrize("second", ["kill", "eof"])
def test_a_kill_or_the_end_of_input_while_stopping_skips_the_grace(tmp_path, second):
    """A rank ignoring SIGTERM, a 30 s grace: ``kill`` (a second Ctrl-C at
    the launcher), or the launcher going away while the job stops, SIGKILLs
    it at once; and it gets SIGTERM once, not once per way it was found."""
    payload = {"job_id": "c" * 32, "kill_grace": 30, "cwd": str(tmp_path), "env": {},
               "ranks": [_rank(0, [sys.executable, "-c", _IGNORES_TERM])]}
    proc, events = _start_agent(payload)
    assert proc.stdin is not None and proc.stdout is not None
    try:
        proc.stdin.write(b'{"cmd":"stop"}\n')
        proc.stdin.flush()
        time.sleep(1.0)
        began = time.monotonic()
        if second == "kill":
            proc.stdin.write(b'{"cmd":"kill"}\n')
            proc.stdin.flush()
        else:
            proc.stdin.close()
        rank_pid = next(e["pid"] for e in events if e.get("ev") == "started")
        left = wait_gone([rank_pid], timeout=10)
        took = time.monotonic() - began
        events += [json.loads(line) for line in proc.stdout]
    finally:
        proc.kill()
        proc.wait()
    assert not left, "the rank was only to be killed at the end of the 30 s grace"
    assert took < 10
    terms = [e for e in events if e.get("ev") == "out" and "TERM" in e["lines"]]
    assert len(terms) == 1, events
    if second == "kill":  # the launcher is still there to hear of it
        exits = [e for e in events if e.get("ev") == "exit"]
        assert exits and exits[0]["signal"] == signal.SIGKILL, events



# A rank that dies on SIGTERM but leaves a process of the job (marked, in a
# session of its own) that ignores it: the teardown waits the grace for it.
_LEAVES_A_SURVIVOR = (
    "import subprocess, sys\n"
    "code = ('import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); '\n"
    "        'print(1, flush=True); time.sleep(60)')\n"
    "child = subprocess.Popen([sys.executable, '-c', code], stdout=subprocess.PIPE,\n"
    "                         start_new_session=True)\n"
    "child.stdout.readline()\n"
    "print('up', child.pid, flush=True)\n"
    "import time; time.sleep(60)\n")


@pytest.mark.parametrize("where", ["stopping", "teardown"])
def test_a_second_signal_to_the_agent_hurries_the_stop_without_a_traceback(tmp_path, where):
    """Signals to the agent itself (mpirun's orted sends SIGTERM on
    MPI_Abort): the first stops the job, with a 30 s grace; a second one,
    while the ranks stop (``stopping``: a rank ignores SIGTERM) or while the
    teardown waits for a survivor (``teardown``), SIGKILLs at once. The
    teardown runs to its end: ``done``, the temporary directory removed,
    no traceback."""
    argv = _IGNORES_TERM if where == "stopping" else _LEAVES_A_SURVIVOR
    payload = {"job_id": "d" * 32, "kill_grace": 30, "cwd": str(tmp_path), "env": {},
               "ranks": [_rank(0, [sys.executable, "-c", argv])]}
    proc, events = _start_agent(payload, stderr=subprocess.PIPE)
    assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
    job: list[int] = []
    try:
        job = [next(e["pid"] for e in events if e.get("ev") == "started")]
        job += [int(w) for w in str(_up_line(events[-1])).split()[1:]]
        tmpdir = os.path.dirname(psutil.Process(job[0]).environ()["DSRUN_ERROR_FILE"])
        proc.send_signal(signal.SIGTERM)
        # stopping: the rank says it got SIGTERM; teardown: the rank's exit is
        # reported (every rank is, so the teardown has begun)
        for line in proc.stdout:
            events.append(json.loads(line))
            if "TERM" in events[-1].get("lines", ()) or events[-1].get("ev") == "exit":
                break
        time.sleep(1.1)  # not the same delivery again (agent_os.REPEAT)
        began = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        left = wait_gone(job, timeout=10)
        took = time.monotonic() - began
        events += [json.loads(line) for line in proc.stdout]
        proc.stdin.close()
        err = proc.stderr.read().decode()
        proc.wait(timeout=10)
    finally:
        proc.kill()
        proc.wait()
        for pid in job:
            with contextlib.suppress(psutil.Error):
                psutil.Process(pid).kill()
    assert not left and took < 10, "the job was only killed at the end of the 30 s grace"
    assert "Traceback" not in err, err
    assert events[-1]["ev"] == "done", events
    assert not os.path.exists(tmpdir), "the agent left its temporary directory"


_FLOODS = ("import sys, time\n"
           "print('up', flush=True)\n"
           "try:\n"
           "    while True:\n"
           "        sys.stdout.write('y' * 199 + '\\n')\n"
           "except BrokenPipeError:\n"
           "    time.sleep(60)\n")


def test_ranks_blocked_by_paused_output_do_not_stall_the_agents_teardown(tmp_path):
    """The launcher holds output (``pause``), so every rank blocks in its
    writes and every pump in the agent waits; a stop must still report all
    exits and ``done`` at once, not wait out each rank's pumps in turn.

    Each rank's readers are given 0.5 s: in parallel that is ~0.5 s in all,
    in turn at least 0.5 s per rank. Ten ranks keep the two far apart."""
    count = 10
    payload = {"job_id": "e" * 32, "kill_grace": 30, "cwd": str(tmp_path), "env": {},
               "ranks": [_rank(r, [sys.executable, "-c", _FLOODS]) for r in range(count)]}
    proc, events = _start_agent(payload)
    assert proc.stdin is not None and proc.stdout is not None
    try:
        proc.stdin.write(b'{"cmd":"pause"}\n')
        proc.stdin.flush()
        time.sleep(2.0)  # the agent's backlog fills, the pumps and ranks block
        began = time.monotonic()
        proc.stdin.write(b'{"cmd":"stop"}\n')
        proc.stdin.flush()
        exits = 0
        for line in proc.stdout:
            event = json.loads(line)
            exits += event.get("ev") == "exit"
            if event.get("ev") == "done":
                break
        took = time.monotonic() - began
    finally:
        proc.kill()
        proc.wait()
    assert exits == count
    # in turn: >= 0.5 * count = 5 s; at once: ~0.5 s, 9x that under load
    assert took < 0.5 * (count - 1), f"the teardown took {took:.1f}s"
