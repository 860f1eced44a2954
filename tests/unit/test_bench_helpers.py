"""The benches' own helpers: the models they build, the async commit timer,
and the refusal of an NCCL run without a GPU per rank."""

from __future__ import annotations

import importlib.util
import sys
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


def test_the_async_commit_time_is_rank_0s_with_the_slowest_beside_it(bench_modules):
    checkpoint = bench_modules[1]
    ranks = [{"rank": r, "save_s": 0.1, "load_s": 1.0, "peak_rss_mib": 1.0,
              "save_hwm_growth_mib": 0.0, "bytes": 1, "step_s": 1.0, "stage_wait_s": 0.0,
              "step_during_save_s": 1.0, "complete_s": s} for r, s in ((1, 0.924), (0, 0.816))]
    row = checkpoint.summarise({"dsrun-async": [ranks]})["dsrun-async"]
    # rank 1's thread ends only once it has polled rank 0's verdict
    assert row["complete_s"] == 0.816 and row["complete_slowest_s"] == 0.924


def test_the_async_commit_time_is_the_savers_own_finish_time(bench_modules, solo, tmp_path):
    """A real world-1 engine: the bench reads AsyncSaver.finished_at, set in
    the save thread, through the public checkpointer(engine) accessor."""
    import dsrun
    from dsrun.runtime.checkpoint.engine_io import checkpointer

    checkpoint = bench_modules[1]
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 1))
    engine, *_ = dsrun.initialize(model=model, config={
        "train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "Adam",
                                                           "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": 3}, "checkpoint": {"async": True}})
    subject = checkpoint.dsrun_subject(engine)
    x = torch.randn(2, 4)

    def step() -> float:
        loss = engine(x).square().mean()
        engine.backward(loss)
        engine.step()
        return float(loss.detach())

    step()
    saver = checkpointer(engine).saver
    assert saver.finished_at is None  # no save yet
    facts: dict = {}
    start = time.perf_counter()
    checkpoint._async_save(subject, str(tmp_path / "ckpt"), step, facts)
    assert saver.finished_at is not None and start < saver.finished_at < time.perf_counter()
    assert facts["save_s"] <= facts["complete_s"] <= time.perf_counter() - start
    assert (tmp_path / "ckpt" / "b" / "manifest.json").exists()  # it did commit
    engine.destroy()


def test_nccl_without_a_gpu_per_rank_is_refused(bench_modules, monkeypatch):
    collectives = bench_modules[2]
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    monkeypatch.setattr(sys, "argv", ["collectives.py", "--backend", "nccl",
                                      "--world", str(gpus + 1)])
    with pytest.raises(SystemExit, match="one CUDA device per rank"):
        collectives.main()
