"""--bind_cores_to_rank in real processes: every rank (injected runtime or
--no_python) runs on its own CPUs with a matching OMP_NUM_THREADS, and a
binding the rank cannot take is one clear error."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from dsrun.launcher.cores import format_cpu_list, rank_cpus
from tests.conftest import ROOT, run_dsrun

CPUS = sorted(os.sched_getaffinity(0))
RANKS = min(2, len(CPUS))

SCRIPT = """
import os
threads = []
import threading
t = threading.Thread(target=lambda: threads.append(sorted(os.sched_getaffinity(0))))
t.start(); t.join()
print("bound", os.environ["LOCAL_RANK"], sorted(os.sched_getaffinity(0)), threads[0],
      os.environ["OMP_NUM_THREADS"], flush=True)
"""


def _expected() -> list[tuple[int, ...]]:
    return list(rank_cpus("here", CPUS, None, RANKS))


def test_each_rank_runs_on_its_own_share(tmp_path) -> None:
    script = tmp_path / "where.py"
    script.write_text(SCRIPT)
    res = run_dsrun("--cpu", "--num_gpus", str(RANKS), "--dist_backend", "none",
                    "--bind_cores_to_rank", str(script), timeout=120)
    assert res.returncode == 0, res.stderr
    lines = sorted(line.split("bound ", 1)[1] for line in res.stdout.splitlines()
                   if "bound " in line)
    assert lines == [f"{i} {list(c)} {list(c)} {len(c)}" for i, c in enumerate(_expected())]


def test_no_python_ranks_are_bound_by_the_wrapper(tmp_path) -> None:
    res = run_dsrun("--cpu", "--num_gpus", str(RANKS), "--dist_backend", "none",
                    "--bind_core_list", format_cpu_list(CPUS[:RANKS]), "--no_python",
                    "grep", "Cpus_allowed_list", "/proc/self/status", timeout=120)
    assert res.returncode == 0, res.stderr
    got = sorted(line.split()[-1] for line in res.stdout.splitlines() if "Cpus_allowed" in line)
    assert got == sorted(str(c) for c in CPUS[:RANKS])


def test_the_dry_run_shows_the_binding_and_bad_lists_fail_before_starting(tmp_path) -> None:
    script = tmp_path / "never.py"
    script.write_text(f"open({str(tmp_path / 'ran')!r}, 'w').write('ran')\n")
    res = run_dsrun("--cpu", "--num_gpus", str(RANKS), "--bind_cores_to_rank", "--dry-run",
                    str(script))
    assert res.returncode == 0, res.stderr
    shares = "  ".join(f"[{format_cpu_list(c)}]" for c in _expected())
    assert f"CPUs per rank: {shares}" in res.stdout
    assert f"DSRUN_CPU_AFFINITY={format_cpu_list(_expected()[0])}" in res.stdout
    beyond = max(CPUS) + 1
    res = run_dsrun("--cpu", "--num_gpus", "1", "--bind_core_list", f"0-{beyond}", str(script))
    assert res.returncode == 2
    assert f"--bind_core_list names CPU(s) {beyond} that host" in res.stderr
    assert not (tmp_path / "ran").exists()


@pytest.mark.parametrize("runtime", [True, False])
def test_a_binding_the_rank_cannot_take_is_one_clear_error(tmp_path, runtime: bool) -> None:
    """What a rank does when the CPUs it is given are not allowed where it
    runs (e.g. a batch system's narrower cgroup than the probe saw)."""
    script = tmp_path / "never.py"
    script.write_text("print('the script ran')\n")
    env = {**os.environ, "DSRUN_CPU_AFFINITY": "65000", "DSRUN_DIST_BACKEND": "none",
           "PYTHONPATH": str(ROOT)}
    if runtime:
        argv = [sys.executable, "-m", "dsrun.runtime.bootstrap", "--script", str(script)]
    else:
        from dsrun import deathsig

        argv = deathsig.wrapper_argv(sys.executable, os.getpid(), ["echo", "the script ran"])
    res = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=60)
    assert res.returncode == 1
    assert "the script ran" not in res.stdout
    assert "cannot bind this rank to CPUs 65000 (DSRUN_CPU_AFFINITY, from " \
           "--bind_cores_to_rank): Invalid argument" in res.stderr
    assert len(res.stderr.strip().splitlines()) <= 2, res.stderr  # no traceback
