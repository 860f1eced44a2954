"""The benches' own helpers: the models they build, the async commit timer,
and the refusal of an NCCL run without a GPU per rank."""

from __future__ import annotations

import importlib.util
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

BENCH = Path(__file__).resolve().parents[2] / "bench"


def _load(name: str) -> Any:
    """bench/NAME.py under a name no other test module uses."""
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def bench_modules():
    path = list(sys.path)
    try:
        checkpoint = _load("checkpoint")  # puts bench/ on sys.path for its own imports
        yield checkpoint.tt, checkpoint, _load("collectives")
    finally:
        sys.path[:] = path
        checkpoint.tt.use_model("small")


def _params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


def test_model_gpu_is_gpu_steps_untied_model(bench_modules):
    tt = bench_modules[0]
    tt.use_model("gpu")
    with torch.device("meta"):
        model = tt.build_model()
        untied = tt.build_model(tied=False)  # as bench/gpu_step.py builds it
    assert model.head.weight is not model.wte.weight
    assert _params(model) == _params(untied) == 217_217_024
    tt.use_model("small")
    with torch.device("meta"):
        small = tt.build_model()
    assert small.head.weight is small.wte.weight and _params(small) == 23_175_168


def test_the_async_commit_time_is_when_the_save_thread_ended(bench_modules):
    checkpoint = bench_modules[1]
    save = threading.Thread(target=time.sleep, args=(0.2,))
    start = time.perf_counter()
    save.start()
    ended = checkpoint._watch(save)
    time.sleep(0.8)  # the training step that overlaps the save, longer than it
    assert 0.19 < ended() - start < 0.6


def test_nccl_without_a_gpu_per_rank_is_refused(bench_modules, monkeypatch):
    collectives = bench_modules[2]
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    monkeypatch.setattr(sys, "argv", ["collectives.py", "--backend", "nccl",
                                      "--world", str(gpus + 1)])
    with pytest.raises(SystemExit, match="one CUDA device per rank"):
        collectives.main()
