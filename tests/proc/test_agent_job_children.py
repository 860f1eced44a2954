"""Real processes: what the node agent makes of the processes a rank starts
- a forked child's error record, helpers that ignore SIGINT on a Ctrl-C, and
background work left running when the job ends (agent_exits.py,
agent_stop.py)."""

from __future__ import annotations

import re
import signal
import time

import pytest

from tests.conftest import (
    descendants,
    read_pids,
    run_dsrun,
    start_dsrun,
    wait_for_pids,
    wait_gone,
)

pytestmark = pytest.mark.proc

_FORKED_RECORD = """\
import json, os, sys, time
rank = int(os.environ["RANK"])
open(os.path.join(sys.argv[1], f"rank{rank}.pid"), "w").write(str(os.getpid()))
if rank == 1:
    if os.fork() == 0:  # a helper that writes the inherited record path, as an
        # older runtime's exit path did in a forked child
        with open(os.environ["DSRUN_ERROR_FILE"], "w") as f:
            json.dump({"rank": 1, "pid": os.getpid(), "time": time.time(),
                       "exc_type": "ValueError", "message": "the helper's own error",
                       "traceback": "ValueError: the helper's own error\\n",
                       "exit_code": 1}, f)
        os._exit(0)
    time.sleep(30)
else:
    time.sleep(1.5)
    raise RuntimeError("REAL ROOT CAUSE on rank 0")
"""


def test_a_forked_childs_error_record_is_not_the_ranks(tmp_path, pid_dir):
    """Rank 1 is only stopped by the teardown; the record its forked child
    wrote earlier must not make it the first to fail."""
    script = tmp_path / "forked_record.py"
    script.write_text(_FORKED_RECORD)
    res = run_dsrun("--cpu", "--num_gpus", "2", "--dist_backend", "none", "--kill_grace", "2",
                    str(script), str(pid_dir))
    assert res.returncode == 1, res.stderr
    assert "job failed: rank 0 on host" in res.stderr, res.stderr
    assert "REAL ROOT CAUSE on rank 0" in res.stderr
    assert "the helper's own error" not in res.stderr, res.stderr
    assert wait_gone(list(wait_for_pids(pid_dir, 2, 1).values()), 2) == []


def test_an_environment_too_big_to_start_a_rank_is_named_not_the_arguments(tmp_path):
    """E2BIG ("Argument list too long") from a variable of .dsrun_env: the
    message says it is the environment, and names the variable, not its value."""
    (tmp_path / ".dsrun_env").write_text("DSRUN_TEST_HUGE=" + "q" * 140_000 + "\n")
    script = tmp_path / "ok.py"
    script.write_text("print('ran')\n")
    res = run_dsrun("--cpu", "--num_gpus", "1", "--dist_backend", "none", str(script),
                    cwd=str(tmp_path))
    assert res.returncode == 127, res.stderr
    assert "Argument list too long: the environment is too big" in res.stderr, res.stderr
    assert "the largest is DSRUN_TEST_HUGE, 140 kB, over Linux's limit" in res.stderr, res.stderr
    assert "qqqq" not in res.stderr and "ran" not in res.stdout


_AMPERSAND_HELPER = """\
import os, sys, time
pid_dir, log, how = sys.argv[1:4]
# A background job of a shell: SIGINT ignored, a TERM trap that cleans up;
# with setsid it is in no rank's group.
os.system(f"{how} sh -c 'trap \\"echo TERM >> {log}; exit 0\\" TERM; "
          f"echo $$ > {pid_dir}/helper_$RANK.pid; while :; do sleep 0.1; done' &")
open(os.path.join(pid_dir, "rank" + os.environ["RANK"] + ".pid"), "w").write(
    str(os.getpid()))
try:
    time.sleep(60)
except KeyboardInterrupt:  # what its helpers got meanwhile
    time.sleep(1.0)
    seen = open(log).read().count("TERM") if os.path.exists(log) else 0
    open(os.path.join(pid_dir, "seen_" + os.environ["RANK"]), "w").write(str(seen))
"""


@pytest.mark.parametrize("how,seen", [("", "0"), ("setsid", "2")])
def test_ctrl_c_terms_helpers_that_ignore_sigint(tmp_path, pid_dir, how, seen):
    """The ranks' groups get the Ctrl-C's SIGINT, as from a terminal. An ``&``
    helper in them ignores it, so it gets SIGTERM once the ranks exited; one
    outside them (setsid) gets SIGTERM at once. Either way its trap runs and
    the job ends long before --kill_grace, without SIGKILL."""
    script, log = tmp_path / "amp.py", tmp_path / "term.log"
    script.write_text(_AMPERSAND_HELPER)
    proc = start_dsrun("--cpu", "--num_gpus", "2", "--dist_backend", "none", "--kill_grace",
                       "12", str(script), str(pid_dir), str(log), how)
    try:
        pids = wait_for_pids(pid_dir, 4)
        job = set(pids.values()) | set(descendants(proc.pid))
        time.sleep(0.3)  # dsrun's handlers are in place once the ranks run
        start = time.monotonic()
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)
        elapsed = time.monotonic() - start
    finally:
        proc.kill()
    assert proc.returncode == 130, err
    assert elapsed < 7, (elapsed, err)  # not the 12 s grace
    assert log.read_text().split() == ["TERM", "TERM"], err
    # The group's helper waited for its rank; the one outside had it at once.
    assert [(pid_dir / f"seen_{r}").read_text() for r in (0, 1)] == [seen, seen], err
    # Only what the teardown stopped after the ranks exited is named.
    named = re.search(r"^\[\w[^:]*:agent\] stopped \d+ processes that ranks 0, 1 left running "
                      r"after the ranks exited: pid \d+ \(sh -c trap ", err, re.M)
    assert (named is not None) == (how == ""), err
    assert "SIGKILL" not in err
    assert wait_gone(sorted(job), 2) == []


_UPLOAD = """\
import os, subprocess, sys
pid_dir = sys.argv[1]
# A background upload the rank does not wait for: in a session of its own.
subprocess.Popen(["sh", "-c", f"echo $$ > {pid_dir}/upload.pid; sleep 30; echo uploaded"],
                 start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
while not os.path.exists(f"{pid_dir}/upload.pid"):
    pass
open(os.path.join(pid_dir, "rank0.pid"), "w").write(str(os.getpid()))
"""


def test_background_work_a_successful_rank_left_is_stopped_and_named(tmp_path, pid_dir):
    script = tmp_path / "upload.py"
    script.write_text(_UPLOAD)
    res = run_dsrun("--cpu", "--num_gpus", "1", "--dist_backend", "none", "--kill_grace", "5",
                    str(script), str(pid_dir))
    assert res.returncode == 0, res.stderr
    pids = read_pids(pid_dir)
    line = re.search(r"^\[\w[^:]*:agent\] stopped 2 processes that rank 0 left running after the "
                     r"job ended: pid (\d+) \(sh -c echo \$\$ > .*\), pid \d+ \(sleep 30\)$",
                     res.stderr, re.M)
    assert line is not None, res.stderr
    assert int(line.group(1)) == pids["upload.pid"]
    assert "SIGKILL" not in res.stderr  # it ended on SIGTERM
    assert wait_gone(list(pids.values()), 2) == []


_STUBBORN = """\
import os, subprocess, sys, time
pid_dir, rank = sys.argv[1], os.environ["RANK"]
IGNORE = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(60)"
if rank == "0":  # it and its helpers ignore SIGTERM: the stop SIGKILLs them
    import signal
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    for n, new in enumerate((False, True)):  # in its group, and in a session of their own
        kid = subprocess.Popen([sys.executable, "-c", IGNORE], start_new_session=new)
        open(os.path.join(pid_dir, f"kid{n}.pid"), "w").write(str(kid.pid))
open(os.path.join(pid_dir, f"rank{rank}.pid"), "w").write(str(os.getpid()))
if rank == "1":
    while len(os.listdir(pid_dir)) < 4:
        time.sleep(0.05)
    time.sleep(0.5)  # the helpers have set their handlers
    sys.exit(3)
time.sleep(60)
"""


def test_processes_besides_the_ranks_that_needed_sigkill_are_named(tmp_path, pid_dir):
    """Rank 1 fails; rank 0 and its two helpers ignore SIGTERM. The helper
    in its group dies with it at --kill_grace, the one in a session of its
    own in the sweep after it: both are named with their rank."""
    script = tmp_path / "stubborn.py"
    script.write_text(_STUBBORN)
    res = run_dsrun("--cpu", "--num_gpus", "2", "--dist_backend", "none", "--kill_grace", "1",
                    str(script), str(pid_dir))
    assert res.returncode == 3, res.stderr
    pids = read_pids(pid_dir)
    line = re.search(r"^\[\w[^:]*:agent\] 2 processes started by rank 0 needed SIGKILL: "
                     r"pid (\d+) \(python\S* -c import signal, time; [^)]*\.\.\.\), "
                     r"pid (\d+) \(python", res.stderr, re.M)
    assert line is not None, res.stderr
    assert {int(line.group(1)), int(line.group(2))} == {pids["kid0.pid"], pids["kid1.pid"]}
    assert wait_gone(list(pids.values()), 2) == []
