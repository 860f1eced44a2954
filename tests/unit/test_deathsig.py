"""The parent-death signal a rank arms (dsrun/deathsig.py), in child processes."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from dsrun import deathsig

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl is Linux's")

PROBE = ("import ctypes, sys; from dsrun import deathsig; "
         "armed = deathsig.die_with_parent(int(sys.argv[1])); "
         "sig = ctypes.c_int(); ctypes.CDLL(None).prctl(2, ctypes.byref(sig), 0, 0, 0); "
         "print(armed, sig.value)")  # 2: PR_GET_PDEATHSIG


def _run(parent: int) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", PROBE, str(parent)], capture_output=True,
                          text=True, timeout=30)


def test_a_direct_child_of_the_agent_arms_the_signal():
    res = _run(os.getpid())
    assert res.returncode == 0 and res.stdout.split() == ["True", "9"], res.stderr


def test_a_process_whose_agent_is_gone_exits_at_once():
    gone = subprocess.Popen(["true"])
    gone.wait()
    res = _run(gone.pid)
    assert res.returncode == deathsig.ORPHANED and res.stdout == ""


def test_a_rank_s_own_child_is_left_alone():
    # the variable names a live process that is not the parent: not the agent's child
    res = _run(1)
    assert res.returncode == 0 and res.stdout.split() == ["False", "0"], res.stderr


def test_wrapper_arms_then_execs(tmp_path):
    out = tmp_path / "out"
    probe = f"import ctypes; s = ctypes.c_int(); ctypes.CDLL(None).prctl(2, ctypes.byref(s), " \
            f"0, 0, 0); open({str(out)!r}, 'w').write(str(s.value))"
    argv = deathsig.wrapper_argv(sys.executable, os.getpid(), [sys.executable, "-c", probe])
    res = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    assert res.returncode == 0, res.stderr
    assert out.read_text() == "9"  # armed by the wrapper, kept across exec
    missing = subprocess.run(deathsig.wrapper_argv(sys.executable, os.getpid(),
                                                   [str(tmp_path / "nope")]),
                             capture_output=True, text=True, timeout=30)
    assert missing.returncode == 127 and "cannot start" in missing.stderr
