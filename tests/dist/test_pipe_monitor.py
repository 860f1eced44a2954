"""Monitors on a pipeline: 2 stages on 2 gloo ranks and 2 stages x 2
replicas on 4, each one ``dsrun --cpu`` job (workers/pipe_monitor_job.py).

What rank 0 (the first stage) wrote is compared with what the script saw
(the losses ``train_batch`` returned, learning rates, loss scale, the
step's gradient norm, the time of each call) and, for the gradient norm
measured for the monitor alone, with the same layers trained in this
process.
"""

from __future__ import annotations

import csv
import importlib.util
import json
import math
import re
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import psutil
import pytest
import torch

from tests.conftest import ROOT, run_dsrun

pytestmark = pytest.mark.dist

WORKER = ROOT / "tests" / "dist" / "workers" / "pipe_monitor_job.py"
ON_2_RANKS = ["wide", "tied", "fp16"]
ON_4_RANKS = ["wide", "tied-zero1"]
JOBS = [(2, name) for name in ON_2_RANKS] + [(4, name) for name in ON_4_RANKS]
PIPE_PARTS = ("batch_input", "pipe_recv_input", "pipe_recv_grad", "pipe_send", "tied_reduce")
ADDED_UP = ("forward", "backward", "step") + PIPE_PARTS


def load_phases() -> ModuleType:
    if "pipe_monitor_job" in sys.modules:
        return sys.modules["pipe_monitor_job"]
    spec = importlib.util.spec_from_file_location("pipe_monitor_job", WORKER)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["pipe_monitor_job"] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


job = load_phases()


def _run_job(world: int, names: list[str], out: Path) -> dict[str, Any]:
    res = run_dsrun("--cpu", "--num_gpus", str(world), str(WORKER), str(out), *names,
                    timeout=300)
    assert res.returncode == 0, res.stderr[-4000:]
    left = [p.pid for p in psutil.process_iter(["cmdline"])
            if str(out) in " ".join(p.info["cmdline"] or ())]
    assert left == [], f"processes of the job still running: {left}"
    return {"out": out, "stdout": res.stdout,
            "seen": {name: json.loads((out / f"{name}.json").read_text()) for name in names}}


@pytest.fixture(scope="module")
def jobs(tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict[str, Any]]:
    return {2: _run_job(2, ON_2_RANKS, tmp_path_factory.mktemp("pipe_monitor2")),
            4: _run_job(4, ON_4_RANKS + ["wide-flops"], tmp_path_factory.mktemp("pipe_monitor4"))}


def read_csv(path: Path) -> tuple[list[str], list[tuple[int, float]]]:
    with open(path, newline="") as handle:
        rows = list(csv.reader(handle))
    return rows[0], [(int(step), float(value)) for step, value in rows[1:]]


def series(run: dict[str, Any], phase: str, name: str, prefix: str = "Train_Samples_"
           ) -> dict[int, float]:
    header, rows = read_csv(run["out"] / phase / f"{prefix}{name}.csv")
    assert header == ["step", name]
    assert len({step for step, _ in rows}) == len(rows)  # one row per step
    return dict(rows)


@pytest.mark.parametrize(("world", "phase"), JOBS)
def test_csv_loss_rows_equal_what_train_batch_returned(jobs: dict, world: int,
                                                       phase: str) -> None:
    run, seen = jobs[world], jobs[world]["seen"][phase]
    assert seen["monitor_enabled"] and seen["stage"] == 0
    rows = seen["rows"]
    loss = series(run, phase, "train_loss")
    assert list(loss) == [row["samples"] for row in rows]
    assert list(loss) == [seen["train_batch_size"] * (i + 1) for i in range(job.STEPS)]
    assert list(loss.values()) == [row["loss"] for row in rows]  # bit for bit
    lr = series(run, phase, "lr")
    assert list(lr.values()) == [row["lr"][0] for row in rows]
    if phase.startswith("tied"):  # WarmupLR: the written rate follows the schedule
        assert len(set(lr.values())) == job.STEPS
    eval_loss = series(run, phase, "eval_loss")
    assert eval_loss == {rows[-1]["samples"]: seen["eval_loss"]}
    _, custom = read_csv(run["out"] / phase / "Custom_writer_rank.csv")
    assert [value for _, value in custom] == [0.0] * job.STEPS  # only rank 0's landed
    info = json.loads((run["out"] / phase / "dsrun_run.json").read_text())
    assert info["data_parallel_size"] == world // 2
    assert info["train_batch_size"] == seen["train_batch_size"]


def reference_norms(phase: str, replicas: int) -> list[float]:
    """The global gradient norm of each step, the same layers in one process."""
    spec = job.PHASES[phase]
    module = job.build(phase, 1)
    opt = torch.optim.SGD(module.parameters(), lr=0.05)
    norms = []
    for step in range(job.STEPS):
        micro = [mb for r in range(replicas) for mb in spec.batch(step, r)]
        for x, y in micro:
            (spec.loss_fn(module(x), y) / len(micro)).backward()
        grads = [p.grad for p in module.parameters() if p.grad is not None]
        norms.append(float(torch.linalg.vector_norm(torch.stack(
            [torch.linalg.vector_norm(g) for g in grads]))))
        opt.step()
        opt.zero_grad()
    return norms


@pytest.mark.parametrize(("world", "phase"), JOBS)
def test_gradient_norm_of_the_whole_model(solo: None, jobs: dict, world: int,
                                          phase: str) -> None:
    rows = jobs[world]["seen"][phase]["rows"]
    norms = series(jobs[world], phase, "grad_norm")
    if job.PHASES[phase].clip > 0 or phase == "fp16":  # the step's own norm, as
        # get_global_grad_norm() says; a step that overflowed writes none
        assert norms == {row["samples"]: row["grad_norm"] for row in rows
                         if math.isfinite(row["grad_norm"])}
        assert len(norms) >= job.STEPS // 2
        return
    assert all(row["grad_norm"] is None for row in rows)  # DeepSpeed's: none without clipping
    want = reference_norms(phase, world // 2)
    assert list(norms.values()) == pytest.approx(want, rel=1e-5)


def test_loss_scale_follows_the_scaler(jobs: dict) -> None:
    rows = jobs[2]["seen"]["fp16"]["rows"]
    scale = series(jobs[2], "fp16", "loss_scale")
    assert list(scale.values()) == [row["loss_scale"] for row in rows]
    assert len(set(scale.values())) > 1  # it doubled (window 2) or halved on overflow
    assert "Train_Samples_loss_scale.csv" not in {p.name for p in (jobs[2]["out"] / "wide")
                                                  .iterdir()}


@pytest.mark.parametrize(("world", "phase"), JOBS)
def test_throughput_in_samples_and_tokens(jobs: dict, world: int, phase: str) -> None:
    run, seen = jobs[world], jobs[world]["seen"][phase]
    samples = series(run, phase, "samples_per_sec")
    assert len(samples) == job.STEPS and all(v > 0 for v in samples.values())
    files = {p.name for p in (run["out"] / phase).iterdir()}
    if not phase.startswith("tied"):  # float inputs: no tokens to count
        assert "Train_Samples_tokens_per_sec.csv" not in files
        return
    tokens = series(run, phase, "tokens_per_sec")
    # the first stage counts the (batch, seq) token ids of every replica
    per_step = (world // 2) * job.PHASES[phase].micro_batches * job.TOKEN_BATCH * job.SEQ
    for step, value in samples.items():
        assert tokens[step] == pytest.approx(value * per_step / seen["train_batch_size"],
                                             rel=1e-9)


@pytest.mark.parametrize(("world", "phase"), JOBS)
def test_breakdown_parts_add_up_to_the_measured_step(jobs: dict, world: int,
                                                     phase: str) -> None:
    run, rows = jobs[world], jobs[world]["seen"][phase]["rows"]
    names = ADDED_UP + ("backward_inner", "backward_allreduce", "monitor", "iteration",
                        "comm_reduce", "comm_gather")
    parts = {p: series(run, phase, f"elapsed_time_ms_{p}") for p in names}
    every = job.PRINT_EVERY
    assert list(parts["forward"]) == [rows[i]["samples"]
                                      for i in range(every - 1, job.STEPS, every)]
    for end in range(every, job.STEPS + 1, every):
        interval = rows[end - every:end]
        at = interval[-1]["samples"]
        measured_ms = 1000.0 * sum(r["seconds"] for r in interval) / every
        total = sum(parts[p][at] for p in ADDED_UP)
        print(f"{world} ranks, {phase}, samples {at}: parts {total:.2f} ms, measured "
              f"{measured_ms:.2f} ms ({100 * (total / measured_ms - 1):+.1f} %)")
        assert abs(total - measured_ms) <= 0.10 * measured_ms, (phase, at, total, measured_ms)
        assert parts["backward_inner"][at] + parts["backward_allreduce"][at] == \
            pytest.approx(parts["backward"][at])
        assert parts["forward"][at] > 0 and parts["backward_inner"][at] > 0
        assert parts["batch_input"][at] > 0  # rank 0 is the first stage: it reads the data
        assert parts["pipe_recv_input"][at] == 0.0  # ... and receives no activations
        assert parts["pipe_recv_grad"][at] > 0 and parts["pipe_send"][at] > 0
        if phase.startswith("tied"):
            assert parts["tied_reduce"][at] > 0
        assert 0.0 < parts["monitor"][at] < parts["step"][at]
        assert parts["iteration"][at] >= measured_ms * 0.9
        replicated = world == 4
        assert (parts["comm_reduce"][at] > 0) == replicated
        zero = job.PHASES[phase].zero  # ZeRO-1 gathers the updated partitions
        assert (parts["comm_gather"][at] > 0) == (replicated and zero > 0)
        if replicated and job.PHASES[phase].zero == 0:  # the data-parallel all-reduce
            assert parts["backward_allreduce"][at] > 0
        else:
            assert parts["backward_allreduce"][at] == 0.0


@pytest.mark.parametrize("world", [2, 4])
def test_each_stage_logs_its_breakdown(jobs: dict, world: int) -> None:
    stdout = jobs[world]["stdout"]
    names = ON_2_RANKS if world == 2 else ON_4_RANKS
    per_stage = len(names) * job.STEPS // job.PRINT_EVERY
    for stage, rank in ((0, 0), (1, world // 2)):  # each stage's first replica
        lines = re.findall(
            rf"\[\w+:{rank}\] \[dsrun\] pipeline stage {stage}: time \(ms per optimizer step, "
            rf"mean of {job.PRINT_EVERY}\): input [\d.]+ \| forward [\d.]+ \| backward [\d.]+ "
            r"\(data-parallel reduce wait [\d.]+\) \| receive wait [\d.]+ \(activations "
            r"[\d.]+, gradients [\d.]+\) \| send [\d.]+ \| tied reduce [\d.]+ \| step [\d.]+ "
            r"\(monitor [\d.]+\) \| iteration [\d.]+; busy \d+% \(1F1B ideal 80%\)", stdout)
        assert len(lines) == per_stage, (stage, rank, stdout[-3000:])
    assert "pipeline stage 0: time" not in re.sub(r"\[\w+:0\] .*", "", stdout)


def test_plot_reads_the_pipeline_breakdown(jobs: dict) -> None:
    from dsrun.runtime.monitor.plot import breakdown_parts
    from dsrun.runtime.monitor.runs import read_run

    run = read_run(str(jobs[2]["out"] / "tied"))
    labels = [label for label, _, _ in breakdown_parts(run)]
    assert labels == ["data input", "forward", "backward compute", "backward comm wait",
                      "receive wait (activations)", "receive wait (gradients)", "send",
                      "tied reduce", "optimizer step", "monitor (inside step)"]


def test_flops_profiler_reports_each_stage(jobs: dict) -> None:
    """2 stages x 2 replicas: the first replica of each stage writes the
    profile of its own layers (NAME.flops.stageS.txt), the others nothing;
    parameters and MACs are those of the stage's layers over the step's 4
    micro-batches."""
    from dsrun.profiling.flops_profiler import macs_to_string, params_to_string
    from dsrun.runtime.pipe.partition import partition_layers

    out = jobs[4]["out"]
    assert sorted(p.name for p in out.glob("wide-flops.flops*")) == [
        "wide-flops.flops.stage0.txt", "wide-flops.flops.stage1.txt"]
    layers = [(job.WIDE, job.WIDE)] * 3 + [(job.WIDE, job.CLASSES)]
    params = [i * o + o for i, o in layers]
    bounds = partition_layers("parameters", 2, ["Wide"] * 3 + ["Linear"], params)
    micro = job.PHASES["wide-flops"].micro_batches
    for stage in (0, 1):
        report = (out / f"wide-flops.flops.stage{stage}.txt").read_text()
        mine = range(bounds[stage], bounds[stage + 1])
        macs = micro * job.WIDE_BATCH * sum(layers[i][0] * layers[i][1] for i in mine)

        def value(label: str, text: str = report) -> str:
            return next(x for x in text.splitlines() if x.startswith(label + ":")).split(
                ":", 1)[1].strip()

        assert value("pipeline stage (its layers only)") == f"{stage} of 2"
        assert value("params per rank") == params_to_string(sum(params[i] for i in mine))
        assert value("fwd MACs per rank") == macs_to_string(macs)
        assert value("micro-batches profiled") == str(micro)
        assert value("samples per rank") == str(micro * job.WIDE_BATCH)
        assert "Profile Summary at step 1:" in report
