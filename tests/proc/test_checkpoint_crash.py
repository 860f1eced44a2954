"""Crash safety of saves, with real processes: a rank SIGKILLed in the
middle of a save (held there by the test pause point) leaves ``latest``
naming the previous tag, which loads; an asynchronous save that fails after
the script ended makes the process exit non-zero."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.conftest import ROOT, dsrun_argv, wait_gone
from tests.dist.test_engine_dist import LAUNCHER_VARS

pytestmark = pytest.mark.proc

WORKER = ROOT / "tests" / "proc" / "workers" / "checkpoint_job.py"


def job(ranks: int, *args: str) -> list[str]:
    return dsrun_argv("--cpu", "--num_gpus", str(ranks), str(WORKER), *args)


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS}
    env.update(extra)
    return env


def wait_for(path: Path, proc: subprocess.Popen, timeout: float = 120) -> str:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if path.exists():
            return path.read_text()
        if proc.poll() is not None:
            raise AssertionError(f"the job ended ({proc.returncode}) before pausing:\n"
                                 f"{proc.communicate()[1][-3000:]}")
        time.sleep(0.05)
    proc.kill()
    raise AssertionError("the save never reached the pause point")


@pytest.mark.parametrize("rank, phase, stage", [(1, "write", 2), (0, "commit", 3),
                                                (0, "latest", 1)])
def test_sigkill_during_a_save_keeps_the_previous_checkpoint(tmp_path: Path, rank: int,
                                                             phase: str, stage: int) -> None:
    out, ckpt = tmp_path / "out", tmp_path / "ckpt"
    out.mkdir()
    ckpt.mkdir()
    mark = tmp_path / "paused"
    env = clean_env(DSRUN_CHECKPOINT_TEST_PAUSE=f"{rank}:{phase}:bad",
                    DSRUN_CHECKPOINT_TEST_PAUSE_MARK=str(mark))
    proc = subprocess.Popen(job(2, "--mode", "crash", "--out", str(out), "--ckpt", str(ckpt),
                                "--stage", str(stage)),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            cwd=str(ROOT))
    paused_rank, paused_phase, pid = wait_for(mark, proc).split()
    assert (int(paused_rank), paused_phase) == (rank, phase)
    os.kill(int(pid), signal.SIGKILL)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode != 0, err[-2000:]
    pids = [int((out / f"pid{r}").read_text()) for r in (0, 1)]
    assert wait_gone(pids, 10) == []
    assert (ckpt / "latest").read_text() == "good"
    assert (ckpt / "good" / "manifest.json").exists()
    if phase == "latest":  # renamed already: complete, only not named by latest
        assert (ckpt / "bad" / "manifest.json").exists()
    else:
        assert not (ckpt / "bad").exists() and (ckpt / "bad.tmp").is_dir()
    load = subprocess.run([sys.executable, str(WORKER), "--mode", "load", "--out", str(out),
                           "--ckpt", str(ckpt), "--stage", "0"],
                          capture_output=True, text=True, timeout=120, env=clean_env(),
                          cwd=str(ROOT))
    assert load.returncode == 0, load.stderr[-3000:]
    good, loaded = torch.load(out / "good.pt"), torch.load(out / "loaded.pt")
    assert good.keys() == loaded.keys()
    assert all(torch.equal(good[k], loaded[k]) for k in good)


def test_an_async_save_failing_after_the_script_ended_fails_the_process(tmp_path: Path) -> None:
    res = subprocess.run([sys.executable, str(WORKER), "--mode", "async-fail", "--out",
                          str(tmp_path), "--ckpt", str(tmp_path)],
                         capture_output=True, text=True, timeout=120, env=clean_env(),
                         cwd=str(ROOT))
    assert "script done" in res.stdout
    assert res.returncode == 1
    assert "(the asynchronous save of tag 'doomed' failed on rank 0)" in res.stderr


def test_an_async_save_failing_while_the_script_raises_reports_both(tmp_path: Path) -> None:
    """The script raises its own error while a failing save is in flight:
    the process fails, and both the script's error and the save's are
    printed (neither hides the other)."""
    res = subprocess.run([sys.executable, str(WORKER), "--mode", "async-fail-raise", "--out",
                          str(tmp_path), "--ckpt", str(tmp_path)],
                         capture_output=True, text=True, timeout=120, env=clean_env(),
                         cwd=str(ROOT))
    assert res.returncode == 1, res.stderr[-3000:]
    assert "RuntimeError: the script's own error" in res.stderr
    assert "(the asynchronous save of tag 'doomed' failed on rank 0)" in res.stderr
