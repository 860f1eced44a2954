"""Ctrl-C reaching a rank: during dsrun's own setup (imports, rendezvous)
it ends the rank quietly with Python's 130 and records no error; once the
script runs it is the script's KeyboardInterrupt, traceback and all."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.conftest import ROOT


def _rank(argv: list[str], tmp_path: Path, **env: str) -> subprocess.Popen:
    full = {**os.environ, "PYTHONPATH": str(ROOT), "DSRUN_ERROR_FILE": str(tmp_path / "err.json"),
            **env}
    return subprocess.Popen(argv, env=full, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def _interrupt(proc: subprocess.Popen, ready, timeout: float = 60) -> tuple[str, str]:
    deadline = time.monotonic() + timeout
    try:
        while not ready():
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "the rank never got ready"
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        return proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


#: A rank whose setup takes long (a slow import, a peer late to the
#: rendezvous): its init_distributed waits in Python, where a signal lands.
SLOW_SETUP = """
import runpy, sys, time
import dsrun.runtime.dist as dist
marker = sys.argv[1]
def slow_init(**kwargs):
    open(marker, "w").close()
    time.sleep(60)
dist.init_distributed = slow_init
sys.argv = ["bootstrap", "--script", sys.argv[2]]
runpy.run_module("dsrun.runtime.bootstrap", run_name="__main__", alter_sys=True)
"""


def test_ctrl_c_while_the_rank_sets_up_is_quiet(tmp_path: Path) -> None:
    script = tmp_path / "never.py"
    script.write_text("print('the script ran')\n")
    marker = tmp_path / "setting-up"
    proc = _rank([sys.executable, "-c", SLOW_SETUP, str(marker), str(script)], tmp_path,
                 DSRUN_DIST_BACKEND="gloo")
    out, err = _interrupt(proc, marker.exists)
    assert proc.returncode == 130, err
    assert "the script ran" not in out
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    assert not (tmp_path / "err.json").exists()


def test_ctrl_c_in_the_script_is_the_scripts_keyboard_interrupt(tmp_path: Path) -> None:
    marker = tmp_path / "running"
    script = tmp_path / "sleeps.py"
    script.write_text(f"import time\nopen({str(marker)!r}, 'w').close()\ntime.sleep(60)\n")
    proc = _rank([sys.executable, "-m", "dsrun.runtime.bootstrap", "--script", str(script)],
                 tmp_path, DSRUN_DIST_BACKEND="none")
    out, err = _interrupt(proc, marker.exists)
    assert proc.returncode == 130, err
    assert f'File "{script}", line 3, in <module>' in err, err
    assert err.rstrip().endswith("KeyboardInterrupt"), err
    assert "bootstrap" not in err, err
    assert (tmp_path / "err.json").exists()
