"""Gradient-reduction cases on 2 gloo ranks, in ONE job (tests/dist/test_optim_reduce.py).

* ``comm_dtype``: an fp32 model trained with SGD at ZeRO stages 0-3, with
  ``communication_data_type`` unset and "bf16": the final weights of each
  run and the ZeRO optimizer's ``comm_dtype``.
* ``sparse``: ``nn.Embedding(sparse=True)`` at stage 0 against the same
  model with ``sparse=False`` (SGD, accumulation 2), with a client
  ``torch.optim.SparseAdam`` against SparseAdam stepped by hand on the
  all-reduced dense gradient, and ``F.embedding(..., sparse=True)`` on a
  plain parameter (a sparse gradient the engine did not expect: densified
  into its bucket).

Usage: optim_reduce_cases.py OUT (writes OUT/rank<R>.json).
"""

from __future__ import annotations

import json
import sys
import traceback
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

import dsrun

STEPS = 3


def _dense_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))


def _weights(module: torch.nn.Module) -> list[float]:
    return torch.cat([p.detach().reshape(-1) for p in module.parameters()]).tolist()


def comm_dtype() -> dict[str, Any]:
    out: dict[str, Any] = {}
    for comm in (None, "bf16"):
        for stage in (0, 1, 2, 3):
            model = _dense_model()
            config = {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 0.0,
                      "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
                      "zero_optimization": {"stage": stage}}
            if comm:
                config["communication_data_type"] = comm
            engine, *_ = dsrun.initialize(model=model, config=config)
            gen = torch.Generator().manual_seed(100 + dist.get_rank())
            for _ in range(STEPS):
                x, y = torch.randn(2, 8, generator=gen), torch.randn(2, 4, generator=gen)
                engine.backward(((engine(x) - y) ** 2).mean())
                engine.step()
            key = f"{comm or 'default'}-s{stage}"
            if stage == 3:
                with dsrun.zero.GatheredParameters(list(model.parameters())):
                    out[key] = _weights(model)
            else:
                out[key] = _weights(model)
            if stage:
                out[f"{key}-dtype"] = str(engine.optimizer.comm_dtype)
            engine.destroy()
    return out


class FunctionalEmbedding(torch.nn.Module):
    """An embedding table that is not an nn.Embedding."""

    def __init__(self, sparse: bool) -> None:
        super().__init__()
        self.table = torch.nn.Parameter(torch.randn(50, 6))
        self.sparse = sparse

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.embedding(ids, self.table, sparse=self.sparse)


def _embedding_model(sparse: bool, functional: bool = False) -> torch.nn.Module:
    torch.manual_seed(0)
    table = FunctionalEmbedding(sparse) if functional else torch.nn.Embedding(50, 6,
                                                                            sparse=sparse)
    return torch.nn.Sequential(table, torch.nn.Flatten(), torch.nn.Linear(18, 1))


def _ids(gen: torch.Generator, step: int) -> torch.Tensor:
    # rows shared by both ranks on even steps, mostly different ones on odd steps
    return torch.randint(0, 50 if step % 2 else 10, (3, 3), generator=gen)


def sparse() -> dict[str, Any]:
    out = _sgd_runs(functional=False)
    out.update(_sparse_adam())
    out["functional"] = _sgd_runs(functional=True)
    return out


def _sgd_runs(functional: bool) -> dict[str, Any]:
    out: dict[str, Any] = {}
    runs = {}
    for is_sparse in (True, False):
        model = _embedding_model(is_sparse, functional)
        config = {"train_micro_batch_size_per_gpu": 3, "gradient_accumulation_steps": 2,
                  "gradient_clipping": 0.0, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
        engine, *_ = dsrun.initialize(model=model, config=config)
        gen = torch.Generator().manual_seed(7 + dist.get_rank())
        layouts = []
        for micro in range(8):
            engine.backward(engine(_ids(gen, micro)).pow(2).mean())
            if engine.is_gradient_accumulation_boundary():
                layouts.append(str(next(model[0].parameters()).grad.layout))
            engine.step()
        runs[is_sparse] = model
        out[f"layouts-{is_sparse}"] = layouts
        engine.destroy()
    out["sgd_max_diff"] = max(float((a - b).abs().max()) for a, b in
                              zip(runs[True].parameters(), runs[False].parameters()))
    out["sgd_weights"] = _weights(runs[True])
    return out


def _sparse_adam() -> dict[str, Any]:
    """dsrun's stage 0 with a client SparseAdam, against SparseAdam stepped
    on the mean of the ranks' dense gradients (all-reduced by hand)."""
    model, reference = _embedding_model(True), _embedding_model(True)
    for m in (model, reference):
        m[2].requires_grad_(False)
    optimizer = torch.optim.SparseAdam([model[0].weight], lr=0.05)
    expected = torch.optim.SparseAdam([reference[0].weight], lr=0.05)
    engine, *_ = dsrun.initialize(model=model, optimizer=optimizer,
                                  config={"train_micro_batch_size_per_gpu": 3,
                                          "gradient_clipping": 0.0})
    gen = torch.Generator().manual_seed(11 + dist.get_rank())
    for step in range(4):
        ids = _ids(gen, step)
        engine.backward(engine(ids).pow(2).mean())
        engine.step()
        reference(ids).pow(2).mean().backward()
        dense = reference[0].weight.grad.to_dense()
        dist.all_reduce(dense)
        reference[0].weight.grad = (dense / dist.get_world_size()).to_sparse(sparse_dim=1)
        expected.step()
        expected.zero_grad()
    engine.destroy()
    return {"sparse_adam_max_diff": float((model[0].weight - reference[0].weight).abs().max())}


CASES: dict[str, Callable[[], dict[str, Any]]] = {"comm_dtype": comm_dtype, "sparse": sparse}


def main() -> None:
    out = Path(sys.argv[1])
    dsrun.init_distributed(dist_backend="gloo")
    results: dict[str, Any] = {}
    for name, case in CASES.items():
        try:
            results[name] = {"ok": True, **case()}
        except Exception:  # noqa: BLE001 - reported to the test, which fails on it
            results[name] = {"ok": False, "error": traceback.format_exc()}
    (out / f"rank{dist.get_rank()}.json").write_text(json.dumps(results))


if __name__ == "__main__":
    main()
