"""DeepSpeed's tutorial scripts (``import dsrun as deepspeed``) run under dsrun."""

from __future__ import annotations

import re

import pytest

from tests.conftest import ROOT, run_dsrun

pytestmark = pytest.mark.proc

TUTORIAL = ROOT / "examples" / "deepspeed_tutorial"
CONFIG_ARGS = ("--deepspeed", "--deepspeed_config", str(TUTORIAL / "ds_config.json"))


def test_tutorial_scripts_train_on_two_cpu_ranks() -> None:
    res = run_dsrun("--cpu", "--num_gpus", "2", str(TUTORIAL / "cifar10_deepspeed.py"),
                    *CONFIG_ARGS, timeout=120)
    assert res.returncode == 0, res.stderr
    losses = [float(m) for m in re.findall(r":0\] \[\d, +\d+\] loss: ([\d.]+)", res.stdout)]
    assert len(losses) == 8, res.stdout  # 2 epochs x 128 micro-batches / 32, rank 0 only
    assert losses[-1] < losses[0] / 4 and losses[3] < losses[0]
    assert "Finished Training" in res.stdout
    assert "step=40, skipped=0" in res.stdout  # the engine's steps_per_print line
    assert "WORLD_SIZE=2 from the dsrun launcher" in res.stdout  # the config summary

    res = run_dsrun("--cpu", "--num_gpus", "2", str(TUTORIAL / "train_loop.py"), *CONFIG_ARGS,
                    "--epochs", "2", timeout=120)
    assert res.returncode == 0, res.stderr
    epochs = [float(m) for m in re.findall(r"epoch \d: loss ([\d.]+)", res.stdout)]
    assert len(epochs) == 2 and epochs[1] < epochs[0]
    assert "micro-batch 8, accumulation 2, global batch 32" in res.stdout
    assert "held-out accuracy" in res.stdout


def test_pipeline_tutorial_trains_two_stages_on_two_cpu_ranks() -> None:
    """``from deepspeed.pipe import PipelineModule, LayerSpec`` after ``import
    dsrun as deepspeed``; two stages on two ranks; train_batch() from the
    training_data given to initialize(); engine(inputs) on the last stage."""
    res = run_dsrun("--cpu", "--num_gpus", "2", str(TUTORIAL / "pipeline_deepspeed.py"),
                    "--deepspeed", "--deepspeed_config",
                    str(TUTORIAL / "ds_pipeline_config.json"), timeout=120)
    assert res.returncode == 0, res.stderr[-4000:]
    assert "2 stage(s) x 1 replica(s); global batch 128" in res.stdout
    assert "stage 0: layers 0-0 (SimpleLayer), 100,480 parameters" in res.stdout
    losses = [float(m) for m in re.findall(r":0\] step \d+: loss ([\d.]+)", res.stdout)]
    assert len(losses) == 5 and losses[-1] < losses[0] / 3, res.stdout
    accuracy = re.search(r"\[\w+:1\] held-out accuracy ([\d.]+) \(stage 1\)", res.stdout)
    assert accuracy and float(accuracy.group(1)) > 0.5, res.stdout
