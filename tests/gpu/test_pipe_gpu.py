"""A pipeline engine on a real GPU: one stage, an NCCL group of one rank
(a one-GPU host cannot run two NCCL ranks, so stage-to-stage messages on
CUDA are not exercised here; their device handling is the same code as the
gloo path the dist tier runs). Checks the CUDA placement of data, labels,
losses and the cross-stage norm against plain torch on the same GPU:
fp32 without clipping bitwise (parameters), with clipping within 1e-6; with
clipping, ZeRO stage 1 and the optimizer offloaded (its gradients in host
memory, the norm on the GPU) within 1e-5 (the update runs on the CPU);
bf16 and fp16 train (finite, falling loss) and keep their dtypes."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import ROOT, dsrun_argv

pytestmark = pytest.mark.gpu

LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                 "MASTER_PORT", "DSRUN_CONFIG", "DSRUN_JOB_ID", "CUDA_VISIBLE_DEVICES")

WORKER = '''
import json, sys
import torch, torch.nn as nn, torch.nn.functional as F
import dsrun
from dsrun.pipe import LayerSpec, PipelineModule

dsrun.init_distributed()
MICRO, M, STEPS = 16, 4, 8

def layers():
    return [LayerSpec(nn.Linear, 32, 64), nn.GELU(), LayerSpec(nn.Linear, 64, 64), nn.GELU(),
            LayerSpec(nn.Linear, 64, 8)]

def batch(step):
    g = torch.Generator().manual_seed(step)
    out = []
    for _ in range(M):
        y = torch.randint(0, 8, (MICRO,), generator=g)
        x = torch.randn(MICRO, 32, generator=g) * 0.5
        x[torch.arange(MICRO), y] += 2.0
        out.append((x, y))
    return out

def config(clip, **extra):
    return {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": M,
            "steps_per_print": 10000, "gradient_clipping": clip,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}},
            **extra}

def parity(clip, **extra):
    module = PipelineModule(layers(), num_stages=1, loss_fn=F.cross_entropy, seed_layers=True)
    engine, _, _, _ = dsrun.initialize(model=module, config=config(clip, **extra))
    ref = PipelineModule(layers(), num_stages=1, seed_layers=True).cuda()
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, weight_decay=0.01)
    losses, ref_losses = [], []
    for step in range(STEPS):
        total = torch.zeros((), device="cuda")
        for x, y in batch(step):
            loss = F.cross_entropy(ref(x.cuda()), y.cuda())
            (loss / M).backward()
            total += loss.detach()
        if clip:
            torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)
        opt.step()
        opt.zero_grad()
        ref_losses.append(float(total / M))
        losses.append(float(engine.train_batch(iter(batch(step)))))
    diff = max((a - b).abs().max().item()
               for a, b in zip(engine.module.parameters(), ref.parameters()))
    x = batch(99)[0][0]
    out = engine(x)
    return {"device": str(next(engine.module.parameters()).device), "losses": losses,
            "ref_losses": ref_losses, "param_diff": diff,
            "forward_diff": (out - ref(x.cuda())).abs().max().item(),
            "forward_device": str(out.device),
            "eval": float(engine.eval_batch(iter(batch(99))))}

def precision(name):
    extra = {"bf16": {"enabled": True}} if name == "bf16" else \\
        {"fp16": {"enabled": True, "auto_cast": True, "initial_scale_power": 12}}
    module = PipelineModule(layers(), num_stages=1, loss_fn=F.cross_entropy, seed_layers=True)
    engine, _, _, _ = dsrun.initialize(model=module, config=config(1.0, **extra))
    losses = [float(engine.train_batch(iter(batch(step)))) for step in range(STEPS)]
    return {"losses": losses, "dtype": str(next(engine.module.parameters()).dtype),
            "skipped": engine.skipped_steps}

OFFLOAD = {"zero_optimization": {"stage": 1, "offload_optimizer": {"device": "cpu"}}}
json.dump({"noclip": parity(0.0), "clip": parity(0.05), "bf16": precision("bf16"),
           "fp16": precision("fp16"), "offload_clip": parity(0.05, **OFFLOAD)},
          open(sys.argv[1], "w"))
'''


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("pipe_gpu")
    script, out = tmp / "pipe_gpu.py", tmp / "results.json"
    script.write_text(WORKER)
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS}
    res = subprocess.run(dsrun_argv("--num_gpus", "1", str(script), str(out)),
                         capture_output=True, text=True, timeout=600, env=env, cwd=str(ROOT))
    assert res.returncode == 0, f"GPU job failed ({res.returncode}):\n{res.stderr[-6000:]}"
    return json.loads(Path(out).read_text())


def test_pipeline_on_the_gpu_matches_plain_torch(results: dict[str, Any]) -> None:
    plain, clipped = results["noclip"], results["clip"]
    assert plain["device"] == "cuda:0" and plain["forward_device"] == "cuda:0"
    # parameters bitwise; the reported loss is a mean whose summation order may differ
    assert plain["param_diff"] == 0.0
    assert max(abs(a - b) for a, b in zip(plain["losses"], plain["ref_losses"])) <= 1e-6
    assert plain["forward_diff"] == 0.0
    assert max(abs(a - b) for a, b in zip(clipped["losses"], clipped["ref_losses"])) <= 1e-6
    assert clipped["param_diff"] <= 1e-6
    assert plain["losses"][-1] < plain["losses"][0]


@pytest.mark.parametrize("name, dtype", [("bf16", "torch.float32"), ("fp16", "torch.float16")])
def test_low_precision_pipelines_train_on_the_gpu(results: dict[str, Any], name: str,
                                                  dtype: str) -> None:
    facts = results[name]
    assert facts["dtype"] == dtype
    assert all(v == v and abs(v) < 1e4 for v in facts["losses"])  # finite
    assert facts["losses"][-1] < facts["losses"][0]


MONITOR_WORKER = '''
import json, sys, time
import torch, torch.nn as nn, torch.nn.functional as F
import dsrun
from dsrun.pipe import LayerSpec, PipelineModule

dsrun.init_distributed()
MICRO, M, STEPS, EVERY, WIDTH = 64, 4, 8, 4, 1024

def layers():
    return [LayerSpec(nn.Linear, 256, WIDTH), nn.GELU(), LayerSpec(nn.Linear, WIDTH, WIDTH),
            nn.GELU(), LayerSpec(nn.Linear, WIDTH, 8)]

def batch(step):
    g = torch.Generator().manual_seed(step)
    return [(torch.randn(MICRO, 256, generator=g), torch.randint(0, 8, (MICRO,), generator=g))
            for _ in range(M)]

out = sys.argv[1]
config = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": M,
          "steps_per_print": EVERY, "wall_clock_breakdown": True,
          "optimizer": {"type": "SGD", "params": {"lr": 1e-2}},
          "csv_monitor": {"enabled": True, "output_path": out, "job_name": "gpu"}}
module = PipelineModule(layers(), num_stages=1, loss_fn=F.cross_entropy, seed_layers=True)
engine, _, _, _ = dsrun.initialize(model=module, config=config)
ref = PipelineModule(layers(), num_stages=1, seed_layers=True).cuda()
opt = torch.optim.SGD(ref.parameters(), lr=1e-2)
rows = []
for step in range(STEPS):
    for x, y in batch(step):
        (F.cross_entropy(ref(x.cuda()), y.cuda()) / M).backward()
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad)
                                                 for p in ref.parameters()]))
    opt.step()
    opt.zero_grad()
    torch.cuda.synchronize()
    start = time.perf_counter()
    loss = engine.train_batch(iter(batch(step)))
    seconds = time.perf_counter() - start
    rows.append({"loss": float(loss), "samples": engine.global_samples, "seconds": seconds,
                 "ref_norm": float(norm)})
json.dump({"rows": rows, "every": EVERY}, open(out + "/rows.json", "w"))
'''


def test_pipeline_monitor_on_the_gpu(tmp_path: Path) -> None:
    """csv_monitor and the breakdown of a pipeline on CUDA (timers synchronise
    the device at every instruction edge): the loss rows are train_batch's,
    the norm measured for the monitor is plain torch's, the parts add up."""
    import csv

    script = tmp_path / "pipe_monitor_gpu.py"
    script.write_text(MONITOR_WORKER)
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS}
    res = subprocess.run(dsrun_argv("--num_gpus", "1", str(script), str(tmp_path)),
                         capture_output=True, text=True, timeout=600, env=env, cwd=str(ROOT))
    assert res.returncode == 0, f"GPU job failed ({res.returncode}):\n{res.stderr[-6000:]}"
    seen = json.loads((tmp_path / "rows.json").read_text())
    rows, every = seen["rows"], seen["every"]

    def series(name: str) -> dict[int, float]:
        with open(tmp_path / "gpu" / f"Train_Samples_{name}.csv", newline="") as handle:
            return {int(s): float(v) for s, v in list(csv.reader(handle))[1:]}

    assert series("train_loss") == {r["samples"]: r["loss"] for r in rows}
    norms = series("grad_norm")
    for r in rows:
        assert norms[r["samples"]] == pytest.approx(r["ref_norm"], rel=1e-5)
    parts = {p: series(f"elapsed_time_ms_{p}") for p in (
        "forward", "backward", "step", "batch_input", "pipe_recv_input", "pipe_recv_grad",
        "pipe_send", "tied_reduce")}
    for end in range(every, len(rows) + 1, every):
        at = rows[end - 1]["samples"]
        measured = 1000.0 * sum(r["seconds"] for r in rows[end - every:end]) / every
        total = sum(values[at] for values in parts.values())
        assert abs(total - measured) <= 0.10 * measured, (at, total, measured)
        assert parts["forward"][at] > 0 and parts["batch_input"][at] > 0


def test_pipeline_clips_offloaded_gradients(results: dict[str, Any]) -> None:
    """The clipping coefficient (a CUDA scalar) scales host gradients."""
    offload = results["offload_clip"]
    assert offload["device"] == "cuda:0"
    assert max(abs(a - b) for a, b in zip(offload["losses"], offload["ref_losses"])) <= 1e-5
    assert offload["param_diff"] <= 1e-5
