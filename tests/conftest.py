"""Shared helpers: run dsrun as a real process and check nothing survives."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

ROOT = Path(__file__).resolve().parent.parent
WORKERS = ROOT / "tests" / "proc" / "workers"


def dsrun_argv(*args: str) -> list[str]:
    return [sys.executable, "-m", "dsrun.launcher.cli", *args]


def run_dsrun(*args: str, timeout: float = 60, env: dict | None = None,
              cwd: str | None = None) -> subprocess.CompletedProcess:
    full_env = {**os.environ, **(env or {})}
    return subprocess.run(dsrun_argv(*args), capture_output=True, text=True, timeout=timeout,
                          env=full_env, cwd=cwd or str(ROOT))


def rank_results(worker: Path, out: Path, world: int, timeout: float,
                 env: dict | None = None) -> list[dict]:
    """Run ``worker OUT`` on ``world`` CPU ranks (it writes ``OUT/rankR.json``);
    the job must succeed; each rank's results in rank order."""
    import json

    res = run_dsrun("--cpu", "--num_gpus", str(world), str(worker), str(out),
                    timeout=timeout, env=env)
    assert res.returncode == 0, res.stderr[-4000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]


def start_dsrun(*args: str, env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen(dsrun_argv(*args), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env={**os.environ, **(env or {})}, cwd=str(ROOT))


def run_agent(payload: dict, timeout: float = 30, stderr: object = None
              ) -> tuple[list[dict], int]:
    """Run a node agent on ``payload`` (its JSON line on stdin): its events
    until ``done`` (or ``timeout``), and its exit status."""
    import json

    proc = subprocess.Popen([sys.executable, "-m", "dsrun.launcher.agent"], cwd=str(ROOT),
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=stderr)
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write((json.dumps(payload) + "\n").encode())
    proc.stdin.flush()
    events = []
    end = time.monotonic() + timeout
    for line in proc.stdout:
        events.append(json.loads(line))
        if events[-1].get("ev") == "done" or time.monotonic() > end:
            break
    proc.stdin.close()
    return events, proc.wait(timeout=10)


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def wait_gone(pids: list[int], timeout: float) -> list[int]:
    """Wait until none of ``pids`` is alive; return the survivors."""
    end = time.monotonic() + timeout
    while True:
        left = [p for p in pids if alive(p)]
        if not left or time.monotonic() > end:
            return left
        time.sleep(0.05)


def read_pids(pid_dir: Path) -> dict[str, int]:
    return {f.name: int(f.read_text()) for f in pid_dir.iterdir() if f.read_text().strip()}


def wait_for_pids(pid_dir: Path, count: int, timeout: float = 20) -> dict[str, int]:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            pids = read_pids(pid_dir)
        except (OSError, ValueError):
            pids = {}
        if len(pids) >= count:
            return pids
        time.sleep(0.05)
    raise AssertionError(f"only {read_pids(pid_dir)} pid files appeared in {timeout}s")


def descendants(pid: int) -> list[int]:
    try:
        return [c.pid for c in psutil.Process(pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


@pytest.fixture
def pid_dir(tmp_path: Path) -> Path:
    d = tmp_path / "pids"
    d.mkdir()
    return d


@pytest.fixture
def solo() -> Iterator[None]:
    """A one-rank gloo group in this process (no ports), destroyed after."""
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
