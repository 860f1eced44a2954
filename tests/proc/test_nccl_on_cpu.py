"""A script asking for NCCL on CPU ranks (runtime/dist.py check_backend):
one clear dsrun error, raised before dsrun's gloo group is torn down."""

from __future__ import annotations

import pytest

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
