"""The partition line a PipelineModule logs counts the parameters each stage
holds: a tied module used twice on one stage is one module there (the
partition itself still weighs each use, as DeepSpeed's does)."""

from __future__ import annotations

import logging

import pytest
import torch

from dsrun.pipe import LayerSpec, PipelineModule, TiedLayerSpec


def logits(emb: torch.nn.Module, h: torch.Tensor) -> torch.Tensor:
    return h @ emb.weight.t()


def test_a_tied_module_on_one_stage_is_counted_once(
        solo: None, caplog: pytest.LogCaptureFixture) -> None:
    vocab, dim = 16, 8
    specs = [TiedLayerSpec("embed", torch.nn.Embedding, vocab, dim),
             LayerSpec(torch.nn.Linear, dim, dim), torch.nn.ReLU(),
             TiedLayerSpec("embed", torch.nn.Embedding, vocab, dim, forward_fn=logits)]
    caplog.set_level(logging.INFO, logger="dsrun")
    module = PipelineModule(specs, num_stages=1, loss_fn=lambda o, y: o.sum())
    held = sum(p.numel() for p in module.parameters())
    assert held == vocab * dim + dim * dim + dim  # 200: the embedding once
    lines = [r.getMessage() for r in caplog.records if "stage 0: layers" in r.getMessage()]
    assert len(lines) == 1 and f", {held:,} parameters" in lines[0], lines
