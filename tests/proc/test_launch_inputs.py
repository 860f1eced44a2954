"""Real processes: how a rank's script is found and run, and how its output
flows (progress bars), compared with plain python where it matters.

One rank, --dist_backend none: each test costs about one interpreter start.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time

import psutil
import pytest

from tests.conftest import ROOT, dsrun_argv, run_dsrun, start_dsrun, wait_gone

pytestmark = pytest.mark.proc
ONE = ["--cpu", "--num_gpus", "1", "--dist_backend", "none"]


def test_a_progress_bar_without_newlines_is_forwarded_while_the_rank_runs(tmp_path):
    go = tmp_path / "go"
    script = tmp_path / "bar.py"
    script.write_text(
        "import os, sys, time\n"
        "sys.stdout.write('\\r step 1/2'); sys.stdout.flush()\n"
        "deadline = time.time() + 20\n"
        f"while not os.path.exists({str(go)!r}) and time.time() < deadline:\n"
        "    time.sleep(0.02)\n"
        "sys.stdout.write('\\r step 2/2\\n'); print('failing now'); sys.exit(3)\n")
    proc = start_dsrun(*ONE, "--log_dir", str(tmp_path / "logs"), str(script))
    timer = threading.Timer(30, proc.kill)
    timer.start()
    try:
        seen = []
        for line in proc.stdout:
            seen.append(line)
            if "step 1/2" in line:
                break
        go.touch()  # the rank was still waiting: the line came before any newline
        out, err = proc.communicate()
    finally:
        timer.cancel()
    assert seen and seen[-1].startswith("[") and seen[-1].endswith(":0]  step 1/2\n"), seen
    assert proc.returncode == 3, err
    assert out.splitlines()[-2:] == [seen[-1].replace("1/2", "2/2").rstrip(),
                                     seen[-1].split()[0] + " failing now"]
    tail = err[err.index("line(s) of rank 0's output"):]
    assert "step 2/2" in tail and "step 1/2" not in tail  # redrawn, as a terminal shows it
    log = (tmp_path / "logs" / "rank_0.log").read_text().splitlines()
    # the runtime's record of the exit follows the output (as for --max_restarts attempts)
    assert log[1:] == [" step 1/2", " step 2/2", "failing now",
                       "# dsrun: rank 0 failed: the script called sys.exit(3)"]


SHOW = ("import sys\n"
        "print(__name__, __file__, sys.argv[0], sys.path[0])\n"
        "raise ValueError('from ' + __file__)\n")


def _target(tmp_path, kind):
    work = tmp_path / "work"
    (work / "app").mkdir(parents=True)
    if kind == "file":
        (work / "app" / "main.py").write_text(SHOW)
        return work, "app/main.py"
    (work / "app" / "__main__.py").write_text(SHOW)
    if kind == "dir":
        return work, "app"
    import zipfile

    with zipfile.ZipFile(work / "app.pyz", "w") as zf:
        zf.write(work / "app" / "__main__.py", "__main__.py")
    return work, "app.pyz"


@pytest.mark.parametrize("kind", ["file", "dir", "zip"])
def test_a_script_sees_what_plain_python_gives_it(tmp_path, kind):
    """__file__ absolute (Python 3.9+), sys.argv[0] as given, sys.path[0] the
    script's directory or the directory/zip holding __main__.py; the traceback
    names the absolute path."""
    work, target = _target(tmp_path, kind)
    plain = subprocess.run([sys.executable, target], cwd=work, capture_output=True, text=True)
    res = run_dsrun(*ONE, target, cwd=str(work))
    assert plain.returncode == res.returncode == 1, res.stderr
    (line,) = [ln.split("] ", 1)[1] for ln in res.stdout.splitlines() if ln.startswith("[")]
    assert line == plain.stdout.strip()
    assert plain.stdout.split()[1].startswith(str(work))  # absolute
    frame = [ln.strip() for ln in plain.stderr.splitlines() if ln.strip().startswith("File")]
    assert frame and frame[-1] in res.stderr


def test_an_uncaught_keyboard_interrupt_exits_130_as_python_does(tmp_path):
    script = tmp_path / "ki.py"
    script.write_text("raise KeyboardInterrupt\n")
    plain = subprocess.run([sys.executable, str(script)], capture_output=True, text=True)
    res = run_dsrun(*ONE, str(script))
    assert plain.returncode in (130, -2)  # python kills itself with SIGINT
    assert res.returncode == 130, res.stderr
    assert "failed first: exit code 130" in res.stderr and "KeyboardInterrupt" in res.stderr


def test_ctrl_c_while_dsrun_imports_exits_130_without_a_traceback():
    """A SIGINT arrives while cli.py imports click (as a Ctrl-C in the first
    quarter second would)."""
    code = ("import importlib.abc, os, signal, sys\n"
            "class Hook(importlib.abc.MetaPathFinder):\n"
            "    def find_spec(self, name, path, target=None):\n"
            "        if name == 'click':\n"
            "            os.kill(os.getpid(), signal.SIGINT)\n"
            "sys.meta_path.insert(0, Hook())\n"
            "from dsrun.launcher.cli import main\n"
            "print('not reached')\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60)
    assert (res.returncode, res.stdout, res.stderr) == (130, "", "")


def test_a_closed_stdout_pipe_stops_the_job_quietly(tmp_path, pid_dir):
    script = tmp_path / "ticks.py"
    script.write_text(
        "import os, sys, time\n"
        f"open(os.path.join({str(pid_dir)!r}, os.environ['RANK']), 'w').write(str(os.getpid()))\n"
        "while True:\n"
        "    print('tick', flush=True); time.sleep(0.02)\n")
    proc = start_dsrun("--cpu", "--num_gpus", "2", "--dist_backend", "none", str(script))
    try:
        assert "tick" in proc.stdout.readline()  # like `dsrun ... | head -1`
        deadline = time.monotonic() + 60  # both ranks up (the pipe holds their ticks)
        while len(list(pid_dir.iterdir())) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        proc.stdout.close()
        err = proc.stderr.read()
        assert proc.wait(timeout=30) == 128 + 13  # as if killed by SIGPIPE
    finally:
        proc.kill()
        proc.wait()
    assert "Traceback" not in err and "Error" not in err, err
    pids = [int(p.read_text()) for p in pid_dir.iterdir()]
    assert len(pids) == 2 and wait_gone(pids, 10) == []


def test_python_m_dsrun_is_the_dsrun_command():
    """`python -m dsrun`: what runs dsrun with another interpreter (its ranks use it too)."""
    res = subprocess.run([sys.executable, "-m", "dsrun", "--version"], capture_output=True,
                         text=True, timeout=60, cwd=str(ROOT))
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith("dsrun ")


def test_a_slow_reader_slows_the_rank_and_the_launchers_memory_stays_bounded(tmp_path):
    """40 MB of output behind a reader that takes nothing for a while: the
    launcher holds a bounded backlog (the agents pause, the rank blocks in
    its writes), then every line arrives once, in order."""
    count, width = 400_000, 100
    script = tmp_path / "flood.py"
    script.write_text(
        "import sys\n"
        f"for i in range({count}):\n"
        f"    sys.stdout.write(f'{{i:09d}}' + 'x' * {width - 10} + '\\n')\n")
    proc = start_dsrun(*ONE, str(script))
    try:
        launcher = psutil.Process(proc.pid)
        base = launcher.memory_info().rss
        peak = base
        for _ in range(60):  # 6 s: unread, the old launcher grew by ~7x the output
            time.sleep(0.1)
            peak = max(peak, launcher.memory_info().rss)
        got = 0
        for line in proc.stdout:
            assert line == f"[{socket.gethostname()}:0] {got:09d}{'x' * (width - 10)}\n", line
            got += 1
        assert proc.wait(timeout=120) == 0, proc.stderr.read()[-2000:]
    finally:
        proc.kill()
        proc.wait()
    assert got == count
    assert peak - base < 60 * 2 ** 20, f"launcher grew by {(peak - base) / 2 ** 20:.0f} MiB"


@pytest.mark.parametrize("closed", ["stdout", "stderr"])
def test_a_closed_stdout_or_stderr_at_start_drops_that_output_and_runs_the_job(tmp_path,
                                                                              closed):
    script = tmp_path / "both.py"
    script.write_text("import sys\nprint('to stdout')\nprint('to stderr', file=sys.stderr)\n"
                      "sys.exit(3)\n")
    fd = 1 if closed == "stdout" else 2
    res = subprocess.run(
        ["sh", "-c", f'exec "$@" {fd}>&-', "sh", *dsrun_argv(*ONE, str(script))],
        capture_output=False, stdout=subprocess.PIPE if fd == 2 else None,
        stderr=subprocess.PIPE if fd == 1 else None, text=True, timeout=60, cwd=str(ROOT))
    assert res.returncode == 3  # the rank's exit code, not a crash of dsrun's output
    if fd == 1:
        assert "to stderr" in res.stderr and "Traceback" not in res.stderr, res.stderr
    else:
        assert "to stdout" in res.stdout


def test_a_closed_pipe_stops_the_job_even_when_its_last_write_failed(tmp_path, pid_dir):
    """The rank writes once more after the reader left, then only waits: the
    failed write alone must stop the job (exit 141), not the rank's end."""
    script = tmp_path / "twice.py"
    script.write_text(
        "import os, time\n"
        f"open(os.path.join({str(pid_dir)!r}, 'rank'), 'w').write(str(os.getpid()))\n"
        "print('A', flush=True); time.sleep(1.0)\n"
        "print('B', flush=True); time.sleep(60)\n")
    proc = start_dsrun(*ONE, str(script))
    try:
        assert "A" in proc.stdout.readline()
        proc.stdout.close()
        began = time.monotonic()
        assert proc.wait(timeout=30) == 128 + 13
        took = time.monotonic() - began
    finally:
        proc.kill()
        proc.wait()
    assert took < 15
    assert wait_gone([int((pid_dir / "rank").read_text())], 10) == []


def test_deepspeeds_shared_memory_buffer_of_the_job_is_removed(tmp_path):
    """Real DeepSpeed on CPU ranks of one host makes a /dev/shm segment per
    rank named after the job's master port and never removes it; the agent
    does, and leaves any other segment alone."""
    other = f"/dev/shm/deepspeed_allreduce_buffer_{os.getuid()}_127.0.0.1_1_0"
    script = tmp_path / "shm.py"
    script.write_text(
        "import os\n"
        "name = ('/dev/shm/deepspeed_allreduce_buffer_%d_%s_%s_%s' % (os.getuid(), "
        "os.environ['MASTER_ADDR'], os.environ['MASTER_PORT'], os.environ['RANK']))\n"
        "open(name, 'w').close()\n"
        "print(name, flush=True)\n")
    open(other, "w").close()
    try:
        res = run_dsrun(*ONE[:-2], "--dist_backend", "gloo", str(script))
        assert res.returncode == 0, res.stderr
        made = res.stdout.split()[-1]
        assert made.startswith("/dev/shm/deepspeed_allreduce_buffer_")
        assert not os.path.exists(made)
        assert os.path.exists(other)
    finally:
        os.unlink(other)
