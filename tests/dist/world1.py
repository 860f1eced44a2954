"""A tiny model and training loop shared by the world-size-1 ZeRO tests."""

from __future__ import annotations

from typing import Any

import torch


def small_model() -> torch.nn.Module:
    """Two linear layers; the first bias is frozen."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(7, 13), torch.nn.Tanh(), torch.nn.Linear(13, 5))
    model[0].bias.requires_grad_(False)
    return model


def two_groups(model: torch.nn.Module) -> list[dict[str, Any]]:
    """Two param groups, the second with its own LR and weight decay."""
    return [{"params": [model[0].weight, model[0].bias]},
            {"params": [model[2].weight, model[2].bias], "lr": 0.03, "weight_decay": 0.1}]


def train(model: torch.nn.Module, opt: Any, gas: int, max_norm: float, zero: bool) -> None:
    """8 steps of ``gas`` micro-steps; ``zero``: ``opt`` is a ZeRO optimizer."""
    g = torch.Generator().manual_seed(1)
    for _ in range(8):
        for _ in range(gas):
            (model(torch.randn(4, 7, generator=g)).square().mean() / gas).backward()
            if zero:
                opt.micro_step_done()
        if zero:
            opt.clip_grad_norm(max_norm)
        elif max_norm:
            trainable = [p for p in model.parameters() if p.requires_grad]
            torch.nn.utils.clip_grad_norm_(trainable, max_norm)
        opt.step()
        opt.zero_grad()
