"""A script asking for a backend its ranks cannot run (runtime/dist.py
check_backend): NCCL on CPU ranks gets one clear dsrun error, raised before
dsrun's gloo group is torn down; so does MPI in a torch built without it."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
import torch.distributed as dist

from tests.conftest import WORKERS, run_dsrun

pytestmark = pytest.mark.proc


def test_nccl_request_on_cpu_ranks_is_refused_and_the_group_kept() -> None:
    res = run_dsrun("--cpu", "--num_gpus", "2", str(WORKERS / "nccl_on_cpu.py"), timeout=120)
    assert res.returncode == 0, res.stderr
    out = res.stdout
    for rank in (0, 1):
        assert (f"refused: torch.distributed.init_process_group(backend='nccl') asked for the "
                f"NCCL backend, but NCCL needs GPUs and rank {rank} is a CPU rank") in out
        assert f"rank {rank} backend gloo sum 2" in out
    assert "AttributeError" not in out + res.stderr


def test_uncaught_refusal_is_the_ranks_reported_error() -> None:
    res = run_dsrun("--cpu", "--num_gpus", "2", "--kill_grace", "2",
                    str(WORKERS / "nccl_on_cpu.py"), "--raise", timeout=120)
    assert res.returncode == 1, res.stderr
    assert "DsrunError: torch.distributed.init_process_group(backend='nccl') asked for the " \
           "NCCL backend" in res.stderr
    assert "_cuda_setDevice" not in res.stderr


def test_init_distributed_keeping_the_group_says_so_on_rank_0(tmp_path: Path) -> None:
    """The script's first call into dsrun, before any initialize() (which
    would make the runtime's logger visible): rank 0's line still shows."""
    script = tmp_path / "kept.py"
    script.write_text("import dsrun as deepspeed\n"
                      "deepspeed.init_distributed(dist_backend='nccl')\n")
    res = run_dsrun("--cpu", "--num_gpus", "2", str(script), timeout=120)
    assert res.returncode == 0, res.stderr
    kept = ("[dsrun] init_distributed(dist_backend='nccl'): the process group exists "
            "already (backend gloo) and is kept, as DeepSpeed keeps an existing group")
    assert re.fullmatch(rf"\[[^:\]]+:0\] {re.escape(kept)}\n", res.stdout), res.stdout


@pytest.mark.skipif(shutil.which("mpirun") is None, reason="mpirun not installed")
@pytest.mark.skipif(dist.is_mpi_available(), reason="this torch has the MPI backend")
def test_mpi_backend_without_mpi_in_torch_is_one_error_per_job() -> None:
    res = run_dsrun("--launcher", "openmpi", "--cpu", "--num_gpus", "2", "--dist_backend",
                    "mpi", "--kill_grace", "2", str(WORKERS / "allreduce.py"),
                    timeout=120)
    assert res.returncode == 1, res.stderr
    assert ("DsrunError: dsrun --dist_backend mpi (DSRUN_DIST_BACKEND) asked for the MPI "
            "backend, but this torch") in res.stderr
    assert "is_mpi_available() is False" in res.stderr
    assert "Traceback" not in res.stdout + res.stderr
    assert "doesn't have MPI built in" not in res.stdout + res.stderr
