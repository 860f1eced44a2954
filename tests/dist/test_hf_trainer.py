"""Hugging Face's Trainer with a DeepSpeed config, under dsrun: the example
script (examples/hf_trainer/train_hf.py), unchanged, on 2 CPU ranks.

Runs where transformers and accelerate are installed (they are not dsrun's
dependencies; the suite skips it otherwise): ZeRO stage 3 gives stage 0's
losses, and the model Trainer.save_model() wrote loads back.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import ROOT, run_dsrun

pytestmark = pytest.mark.dist
transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

SCRIPT = ROOT / "examples" / "hf_trainer" / "train_hf.py"


def _losses(stage: int, out: Path) -> list[list[float]]:
    res = run_dsrun("--cpu", "--num_gpus", "2", str(SCRIPT), "--stage", str(stage),
                    "--steps", "4", "--out", str(out), timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    line = next(x for x in res.stdout.splitlines() if "LOSSES" in x)
    return json.loads(line.split("LOSSES", 1)[1])


def test_trainer_at_zero_stages_0_and_3(tmp_path: Path) -> None:
    plain, sharded = _losses(0, tmp_path / "s0"), _losses(3, tmp_path / "s3")
    assert [step for step, _ in plain] == [1, 2, 3, 4]
    assert plain == sharded  # the Trainer logs 4 decimals
    model = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "s3" / "final")
    reference = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "s0" / "final")
    for (name, a), (_, b) in zip(model.named_parameters(), reference.named_parameters()):
        assert (a - b).abs().max() < 1e-5, name
