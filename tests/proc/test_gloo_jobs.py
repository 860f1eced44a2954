"""Real gloo jobs: the injected runtime brings up the process group."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from tests.conftest import ROOT, WORKERS, run_dsrun

pytestmark = pytest.mark.proc


@pytest.mark.parametrize("n", [2, 3])
def test_allreduce_job(n):
    res = run_dsrun("--cpu", "--num_gpus", str(n), str(WORKERS / "allreduce.py"))
    assert res.returncode == 0, res.stderr
    expected = n * (n + 1) // 2
    lines = sorted(ln for ln in res.stdout.splitlines() if "sum" in ln)
    assert len(lines) == n
    for rank, line in enumerate(lines):
        assert line.endswith(f"] rank {rank}/{n} backend gloo sum {expected}")
        assert line.startswith("[") and f":{rank}] " in line
    assert f"starting {n} CPU rank(s) with gloo" in res.stderr


def test_script_calling_init_process_group_itself_and_failing_rank_stops_barrier():
    start = time.monotonic()
    res = run_dsrun("--cpu", "--num_gpus", "2", "--kill_grace", "2",
                    str(WORKERS / "torchrun_style.py"), "--fail")
    assert res.returncode == 3, res.stderr
    assert time.monotonic() - start < 30  # not the barrier's own timeout (run_dsrun's 60 s)
    assert "argv ['--fail'] sum 1 main __main__" in res.stdout
    assert "rank 1 on host" in res.stderr and "exit code 3" in res.stderr


def test_module_mode_and_rank0_example(tmp_path):
    res = run_dsrun("--cpu", "--num_gpus", "3", str(ROOT / "examples" / "rank0_print.py"))
    assert res.returncode == 0, res.stderr
    assert res.stdout.count("only rank 0 prints this line") == 1
    assert res.stdout.count("every rank prints this") == 3
    pkg = tmp_path / "mypkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "job.py").write_text(
        "import sys, torch.distributed as dist\n"
        "print('module', __name__, dist.get_rank(), sys.argv[1:])\n")
    res = run_dsrun("--cpu", "--num_gpus", "2", "-m", "mypkg.job", "--x", "1", cwd=str(tmp_path))
    assert res.returncode == 0, res.stderr
    assert "module __main__ 1 ['--x', '1']" in res.stdout


def test_world_size_one_under_plain_python(tmp_path):
    script = tmp_path / "solo.py"
    script.write_text(
        "import dsrun, torch, torch.distributed as dist\n"
        "dsrun.init_distributed()\n"
        "dsrun.init_distributed()  # second call is a no-op\n"
        "t = torch.ones(2); dist.all_reduce(t)\n"
        "print(dist.get_rank(), dist.get_world_size(), t.tolist())\n")
    env = {k: v for k, v in __import__("os").environ.items()
           if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env["DSRUN_ACCELERATOR"] = "cpu"  # gloo even on a GPU host: the tensors are CPU ones
    res = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         env=env, timeout=60)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "0 1 [1.0, 1.0]"


def test_cpu_flag_runs_cpu_ranks_on_a_host_with_fewer_gpus():
    # DSRUN_FAKE_GPUS=1: the launcher sees one GPU; --cpu still gives 2 gloo ranks
    res = run_dsrun("--cpu", "--num_gpus", "2", str(WORKERS / "allreduce.py"),
                    env={"DSRUN_FAKE_GPUS": "1"})
    assert res.returncode == 0, res.stderr
    assert "--cpu: starting 2 CPU rank(s) with gloo" in res.stderr
    assert sum("backend gloo sum 3" in ln for ln in res.stdout.splitlines()) == 2
    refused = run_dsrun("--num_gpus", "2", str(WORKERS / "allreduce.py"),
                        env={"DSRUN_FAKE_GPUS": "1"})
    assert refused.returncode == 2 and "more GPUs than this host has (1)" in refused.stderr


def test_timeout_passed_to_init_process_group_by_the_script_is_applied():
    res = run_dsrun("--cpu", "--num_gpus", "2", "--kill_grace", "1",
                    str(WORKERS / "pg_timeout.py"), timeout=120)
    assert res.returncode == 5, res.stderr
    line = next(ln for ln in res.stdout.splitlines() if "after" in ln)
    assert "TIMEOUT after" in line, line
    assert float(line.split("after ")[1].split("s")[0]) < 10, line
