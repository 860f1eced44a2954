"""The model, data and configs of the DeepSpeed checkpoint fixtures.

Imported by ``make.py`` (run under a real DeepSpeed, it writes the
fixtures) and by dsrun's tests (which import the fixtures and continue
training in dsrun): both sides train the same model on the same batches
with the same optimizer and schedule, so dsrun's losses after an import
can be compared with the ones DeepSpeed recorded after its own resume.

Needs only torch: no DeepSpeed, no dsrun.

* :class:`Tiny`: three Linear layers and a LayerNorm, a frozen parameter
  (``offset``) and a persistent buffer (``scale``); 499 trainable elements
  (the odd output width leaves padding in the flat ZeRO partitions).
* :func:`batch`: the global batch of optimizer step ``step`` (a function of
  the step only, not of any RNG state: DeepSpeed saves no RNG state), of
  which rank ``r`` of ``world`` takes rows ``[r * n, (r + 1) * n)``.
  At :data:`OVERFLOW_STEP` of an fp16 fixture the targets are 1e5, which
  is inf in fp16: DeepSpeed skips that step and shrinks its loss scale.
* :func:`param_groups`: two groups (weights with weight decay; biases and
  the LayerNorm without), or one (stage 0: DeepSpeed saves no parameter
  names with a stage-0 optimizer).
* :data:`FIXTURES`: name -> (ZeRO stage, precision).
"""

from __future__ import annotations

from typing import Any

import torch

FEATURES, HIDDEN, OUT = 8, 16, 3
GLOBAL_BATCH = 8
SAVE_AFTER = 4      # optimizer steps before DeepSpeed saves
CONTINUE = 4        # steps after the resume whose losses are the oracle
OVERFLOW_STEP = 1   # fp16 fixtures: the step whose gradients overflow
SEED = 0
WORLD = 2           # ranks that saved every fixture

FIXTURES: dict[str, tuple[int, str]] = {
    "stage0_fp32": (0, "fp32"),
    "stage1_fp16": (1, "fp16"),
    "stage1_bf16": (1, "bf16"),  # fp32 gradient accumulation: DeepSpeed's BF16_Optimizer
    "stage2_bf16": (2, "bf16"),
    "stage3_fp32": (3, "fp32"),
    "stage3_bf16": (3, "bf16"),
}


class Tiny(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(FEATURES, HIDDEN)
        self.norm = torch.nn.LayerNorm(HIDDEN)
        self.fc2 = torch.nn.Linear(HIDDEN, HIDDEN)
        self.fc3 = torch.nn.Linear(HIDDEN, OUT)
        self.offset = torch.nn.Parameter(torch.randn(HIDDEN) * 0.1, requires_grad=False)
        self.register_buffer("scale", torch.tensor([1.5, 0.5, 2.0]))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        dtype = self.fc1.weight.dtype  # the module's (DeepSpeed halves it for fp16/bf16)
        h = torch.relu(self.fc1(x.to(dtype)))
        h = torch.tanh(self.fc2(self.norm(h) + self.offset))
        out = self.fc3(h) * self.scale
        return torch.nn.functional.mse_loss(out, y.to(out.dtype))


def build() -> Tiny:
    torch.manual_seed(SEED)
    return Tiny()


def batch(step: int, rank: int, world: int, precision: str = "fp32"
          ) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(GLOBAL_BATCH, FEATURES, generator=gen)
    y = torch.randn(GLOBAL_BATCH, OUT, generator=gen)
    if precision == "fp16" and step == OVERFLOW_STEP:
        y = torch.full_like(y, 1e5)
    rows = GLOBAL_BATCH // world
    return x[rank * rows:(rank + 1) * rows], y[rank * rows:(rank + 1) * rows]


def param_groups(model: torch.nn.Module, stage: int) -> list[dict[str, Any]]:
    if stage == 0:
        return [{"params": list(model.parameters())}]
    decay = [p for n, p in model.named_parameters() if n.endswith("weight") and "norm" not in n]
    rest = [p for n, p in model.named_parameters() if not (n.endswith("weight")
                                                           and "norm" not in n)]
    return [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}]


def config(stage: int, precision: str, world: int) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "train_batch_size": GLOBAL_BATCH,
        "train_micro_batch_size_per_gpu": GLOBAL_BATCH // world,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "steps_per_print": 10**9,
        "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "betas": [0.9, 0.95],
                                                  "eps": 1e-8, "weight_decay": 0.1,
                                                  "torch_adam": True}},
        "scheduler": {"type": "WarmupDecayLR", "params": {
            "warmup_min_lr": 0.0, "warmup_max_lr": 0.01, "warmup_num_steps": 3,
            "total_num_steps": 20, "warmup_type": "linear"}},
        "zero_optimization": {"stage": stage},
    }
    if precision == "fp16":
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 8, "loss_scale_window": 3,
                       "hysteresis": 2, "min_loss_scale": 1}
    elif precision == "bf16":
        cfg["bf16"] = {"enabled": True}
        if stage == 1:  # makes DeepSpeed pick its BF16_Optimizer (bf16_zero_* files)
            cfg["data_types"] = {"grad_accum_dtype": "fp32"}
    return cfg
