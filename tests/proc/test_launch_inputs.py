"""Real processes: how a rank's script is found and run, and how its output
flows (progress bars), compared with plain python where it matters.

One rank, --dist_backend none: each test costs about one interpreter start.
"""

from __future__ import annotations

import threading

import pytest

from tests.conftest import start_dsrun

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
    assert log[1:] == [" step 1/2", " step 2/2", "failing now"]
