"""ZeRO stage 3 on models that are awkward to partition, against torch DDP,
in one 2-rank dsrun job (fp32, SGD with momentum, no clipping, every
parameter partitioned: ``stage3_param_persistence_threshold`` 0); each
rank writes ``OUT_DIR/rank<R>.json`` and tests/dist/test_zero3_awkward.py
judges:

* **ckpt_***: a checkpointed *plain function* (not a module) calls
  ``F.linear(h, self.head.weight, self.head.bias)`` - a checkpointed
  LM-head loss - by torch's non-reentrant checkpoint (also with
  ``memory_efficient_linear`` off), torch's reentrant one and
  ``deepspeed.checkpointing.checkpoint``; ``ckpt_method`` checkpoints a
  method that calls a Linear twice and reads a sibling's weight. The
  non-reentrant recomputation runs outside every hooked module; it once
  took another ``F.linear`` than the original forward and torch stopped
  with "A different number of tensors was saved".
* **max_norm**: ``nn.Embedding(max_norm=1.0)``, whose forward renormalises
  the looked-up rows of the gathered weight in place (with and without
  ``zero.Init``; the same data on both ranks, so DDP's replicas agree); the
  renorm was once dropped with the gathered data. **max_norm_split**: ranks
  that look up different rows, one of which straddles two shards.
* **zero_size**: a ``Parameter(torch.zeros(0, 8))``, an ``nn.Linear(8, 0)``
  and a scalar parameter (with and without ``zero.Init``); once an
  IndexError at the first step and a reshape error in the linear's backward;
  ``empty_gather``: ``all_gather_flat`` of an empty shard, by each gather
  strategy (the IndexError's place).

Each case records the per-step losses, the final full parameters and how
many times gathered data was copied back into a shard (an in-place write
seen at release), or the error it raised. Usage: ``dsrun --num_gpus 2 zero3_awkward.py OUT_DIR``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import dsrun as deepspeed
from dsrun.runtime.zero import whole_edits
from dsrun.runtime.zero.comm import GATHER_STRATEGIES, CommStrategy, all_gather_flat

V, D, STEPS = 12, 8, 3


def config(**zero: Any) -> dict[str, Any]:
    return {"train_micro_batch_size_per_gpu": 4, "gradient_clipping": 0.0,
            "zero_allow_untested_optimizer": True,
            "optimizer": {"type": "SGD", "params": {"lr": 0.05, "momentum": 0.9}},
            "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                                  **zero}}


class CkptHead(nn.Module):
    """A checkpointed plain function reads the head's weight (``how``: the
    checkpoint; None: no checkpoint, the DDP reference)."""

    def __init__(self, how: str | None) -> None:
        super().__init__()
        self.how = how
        self.emb, self.l, self.head = nn.Embedding(V, D), nn.Linear(D, D), nn.Linear(D, V)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        return F.linear(h, self.head.weight, self.head.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.l(self.emb(x).mean(1)))
        fn = lambda h: self.logits(h)  # noqa: E731 - a plain function, as in the report
        if self.how == "torch":
            return torch.utils.checkpoint.checkpoint(fn, h, use_reentrant=False)
        if self.how == "reentrant":
            return torch.utils.checkpoint.checkpoint(fn, h, use_reentrant=True)
        if self.how == "deepspeed":
            return deepspeed.checkpointing.checkpoint(fn, h)
        return fn(h)


class CkptMethod(nn.Module):
    """A checkpointed method calls a Linear twice and reads a sibling's weight."""

    def __init__(self, how: str | None) -> None:
        super().__init__()
        self.how = how
        self.emb, self.l, self.l2 = nn.Embedding(V, D), nn.Linear(D, D), nn.Linear(D, D)
        self.head = nn.Linear(D, V)

    def block(self, h: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.l(torch.tanh(self.l(h)))) + F.linear(h, self.l2.weight, self.l2.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x).mean(1)
        if self.how is not None:
            h = torch.utils.checkpoint.checkpoint(self.block, h, use_reentrant=False)
        else:
            h = self.block(h)
        return self.head(h)


class MaxNorm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(V, D, padding_idx=0, max_norm=1.0)
        self.head = nn.Linear(D, V)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.emb(x).mean(1))


class ZeroSize(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb, self.l, self.head = nn.Embedding(V, D), nn.Linear(D, D), nn.Linear(D, V)
        self.scale = nn.Parameter(torch.tensor(1.5))
        self.empty = nn.Parameter(torch.zeros(0, D))
        self.narrow = nn.Linear(D, 0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.l(self.emb(x).mean(1))) * self.scale
        return self.head(h + self.empty.sum() + self.narrow(h).sum())


def batches(rank: int, same: bool) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(100 + (0 if same else rank))
    return [(torch.randint(0, V, (4, 5), generator=g), torch.randint(0, V, (4,), generator=g))
            for _ in range(STEPS)]


def full_values(model: nn.Module) -> dict[str, list[float]]:
    with deepspeed.zero.GatheredParameters(list(model.parameters())):
        return {name: [float(v) for v in p.detach().reshape(-1)]
                for name, p in model.named_parameters()}


def ddp_run(build: Callable[[], nn.Module], data: list) -> dict[str, Any]:
    torch.manual_seed(0)
    model = build()
    ddp = DDP(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    losses = []
    for x, y in data:
        loss = F.cross_entropy(ddp(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return {"losses": losses, "params": {n: [float(v) for v in p.detach().reshape(-1)]
                                         for n, p in model.named_parameters()}}


COPY_BACKS = [0]  # full data copied into the shard (in training: an in-place write seen)


def _counting_refresh(param: torch.Tensor, _real: Callable[..., None] = whole_edits.refresh_shard
                      ) -> None:
    COPY_BACKS[0] += 1
    _real(param)


whole_edits.refresh_shard = _counting_refresh


def zero3_run(build: Callable[[], nn.Module], data: list, init: bool = False,
              **zero: Any) -> dict[str, Any]:
    try:
        torch.manual_seed(0)
        if init:
            with deepspeed.zero.Init(config_dict_or_path=config(**zero)):
                model = build()
        else:
            model = build()
        engine, *_ = deepspeed.initialize(model=model, config=config(**zero))
        COPY_BACKS[0] = 0  # training's only (initialize() takes zero.Init's whole values)
        losses = []
        for x, y in data:
            loss = F.cross_entropy(engine(x), y)
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        engine.destroy()
        return {"losses": losses, "params": full_values(model), "copy_backs": COPY_BACKS[0]}
    except Exception as err:  # both ranks raise alike; the test shows it
        return {"error": f"{type(err).__name__}: {err}"}


def max_norm_split() -> dict[str, Any]:
    """``Embedding(5, 8, max_norm=1)``, every element partitioned (shards of
    20: row 2 straddles the two): rank 0 looks up row 0, rank 1 row 2, in
    one forward. Returns the weight before and after, and each rank's own
    renorm of a full copy (what a DDP replica would hold)."""
    torch.manual_seed(0)
    emb = nn.Embedding(5, 8, max_norm=1.0)
    with torch.no_grad():
        emb.weight.mul_(3.0)  # every row's norm above 1
    before = emb.weight.detach().clone()
    engine, *_ = deepspeed.initialize(model=emb, config=config())
    ids = torch.tensor([[0]]) if dist.get_rank() == 0 else torch.tensor([[2]])
    with torch.no_grad():
        engine(ids)
    own = []
    for rank_ids in (torch.tensor([[0]]), torch.tensor([[2]])):
        copy = before.clone()
        F.embedding(rank_ids, copy, max_norm=1.0)  # renorms copy's looked-up rows in place
        own.append([float(v) for v in copy.reshape(-1)])
    after = full_values(emb)["weight"]
    engine.destroy()
    return {"before": [float(v) for v in before.reshape(-1)], "after": after, "own": own,
            "shard": emb.weight.ds_spec.shard_numel}


def empty_gathers() -> dict[str, Any]:
    out: dict[str, Any] = {}
    for how in GATHER_STRATEGIES:
        try:
            gathered = all_gather_flat(torch.empty(0), strategy=CommStrategy(gather=how))
            out[how] = list(gathered.shape)
        except Exception as err:
            out[how] = f"{type(err).__name__}: {err}"
    return out


def main() -> None:
    out_dir = Path(sys.argv[1])
    rank = dist.get_rank()
    data, same = batches(rank, same=False), batches(rank, same=True)
    head = ddp_run(lambda: CkptHead(None), data)
    method = ddp_run(lambda: CkptMethod(None), data)
    result: dict[str, Any] = {
        "rank": rank,
        "ddp": {"head": head, "method": method, "max_norm": ddp_run(MaxNorm, same),
                "zero_size": ddp_run(ZeroSize, data)},
        "zero3": {
            "ckpt_torch": zero3_run(lambda: CkptHead("torch"), data),
            "ckpt_torch_plain_linear": zero3_run(lambda: CkptHead("torch"), data,
                                                 memory_efficient_linear=False),
            "ckpt_reentrant": zero3_run(lambda: CkptHead("reentrant"), data),
            "ckpt_deepspeed": zero3_run(lambda: CkptHead("deepspeed"), data),
            "ckpt_method": zero3_run(lambda: CkptMethod("torch"), data),
            "max_norm": zero3_run(MaxNorm, same),
            "max_norm_init": zero3_run(MaxNorm, same, init=True),
            "zero_size": zero3_run(ZeroSize, data),
            "zero_size_init": zero3_run(ZeroSize, data, init=True),
        },
    }
    result["max_norm_split"] = max_norm_split()
    result["empty_gather"] = empty_gathers()  # last: before the fix it left the ranks out of step
    (out_dir / f"rank{rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
