"""Models whose build touches children already partitioned by ``zero.Init``,
in one 2-rank dsrun job (fp32, every parameter partitioned:
``stage3_param_persistence_threshold`` 0); each rank writes
``OUT_DIR/rank<R>.json`` and tests/dist/test_zero3_init_builds.py judges:

* **encoder**: ``nn.TransformerEncoder`` deep-copies its built layer (once
  refused, "cannot copy.deepcopy MultiheadAttention.in_proj_weight"): the
  largest difference of its gathered parameters from a plain-torch build
  with the same seed, and three training losses of the engine and of plain
  torch (SGD, every rank the same batch, so the averaged gradient is
  plain torch's);
* **mha**: ``nn.MultiheadAttention`` sets its built ``out_proj.bias`` to 0
  (``constant_`` on a released parameter once did nothing: the bias kept
  Linear's random values): differences per parameter from plain torch;
* **trunc_normal**: a parent re-initialising a built child with
  ``trunc_normal_`` (``uniform_``, ``erfinv_``, ``mul_``, ``add_``,
  ``clamp_``) and building one more child after it (the random stream
  must be plain torch's too): differences per parameter;
* **twin**: ``copy.deepcopy(model)`` inside the ``with zero.Init()`` block:
  whether the copy's ids are new and its gathered values equal;
* **write_outside**: ``torch.nn.init.zeros_`` and an EMA's ``mul_`` on
  ``engine.module``'s released weight after ``initialize()``: refused
  (they did nothing), and the values after it.

Usage: ``dsrun --cpu --num_gpus 2 zero3_init_builds.py OUT_DIR``.
"""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

import dsrun as deepspeed
from dsrun.errors import DsrunError


def config() -> dict[str, Any]:
    return {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 0.0,
            "steps_per_print": 10 ** 9, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
            "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}


def outcome(run: Callable[[], Any]) -> dict[str, Any]:
    try:
        return {"ok": run()}
    except Exception as err:  # noqa: BLE001 - the error is the result
        return {"error": type(err).__name__, "message": str(err),
                "dsrun": isinstance(err, DsrunError)}


def built(make: Callable[[], nn.Module]) -> tuple[nn.Module, nn.Module]:
    """(plain torch, built under zero.Init), each from seed 0."""
    torch.manual_seed(0)
    plain = make()
    torch.manual_seed(0)
    with deepspeed.zero.Init(config_dict_or_path=config()):
        model = make()
    return plain, model


def differences(plain: nn.Module, model: nn.Module) -> dict[str, float]:
    with deepspeed.zero.GatheredParameters(list(model.parameters())):
        return {name: (p.detach() - q.detach()).abs().max().item()
                for (name, p), q in zip(model.named_parameters(), plain.parameters())}


def encoder() -> nn.Module:
    layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
    return nn.Sequential(nn.TransformerEncoder(layer, 2, enable_nested_tensor=False),
                         nn.Linear(8, 1))


def train_encoder() -> dict[str, Any]:
    plain, model = built(encoder)
    out: dict[str, Any] = {"params": max(differences(plain, model).values())}
    engine, *_ = deepspeed.initialize(model=model, config=config(),
                                      model_parameters=model.parameters())
    sgd = torch.optim.SGD(plain.parameters(), lr=0.1)
    losses: dict[str, list[float]] = {"engine": [], "plain": []}
    for step in range(3):
        x = torch.linspace(-1, 1, 48).view(2, 3, 8) * (step + 1)
        loss = engine(x).pow(2).mean()
        engine.backward(loss)
        engine.step()
        losses["engine"].append(loss.item())
        ref = plain(x).pow(2).mean()
        sgd.zero_grad()
        ref.backward()
        sgd.step()
        losses["plain"].append(ref.item())
    out["losses"] = losses
    return out


class Reinit(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(8, 8)
        nn.init.trunc_normal_(self.first.weight, std=0.02)
        nn.init.zeros_(self.first.bias)
        self.second = nn.Linear(8, 4)


def twin() -> dict[str, Any]:
    torch.manual_seed(0)
    with deepspeed.zero.Init(config_dict_or_path=config()):
        model = nn.Sequential(nn.Linear(4, 6), nn.Linear(6, 3))
        copied = copy.deepcopy(model)
    ids = [p.ds_id for p in model.parameters()]
    new = [p.ds_id for p in copied.parameters()]
    released = all(p.data.numel() == 0 for p in copied.parameters())
    with deepspeed.zero.GatheredParameters(list(model.parameters())):
        return {"new_ids": not set(ids) & set(new), "released": released,
                "diff": max(differences(model, copied).values())}


def write_outside() -> dict[str, Any]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.Linear(6, 3))
    deepspeed.initialize(model=model, config=config(), model_parameters=model.parameters())
    weight = model[0].weight
    with deepspeed.zero.GatheredParameters([weight]):
        before = weight.detach().clone()
    with torch.no_grad():
        out = {"zeros_": outcome(lambda: nn.init.zeros_(weight)),
               "mul_": outcome(lambda: weight.mul_(0.9))}
    with deepspeed.zero.GatheredParameters([weight]):
        out["unchanged"] = torch.equal(weight.detach(), before)
    for key in ("zeros_", "mul_"):
        out[key].pop("ok", None)
    return out


def main() -> None:
    deepspeed.init_distributed(dist_backend="gloo")
    out_dir = Path(sys.argv[1])
    rank = dist.get_rank()
    result = {
        "rank": rank,
        "encoder": outcome(train_encoder),
        "mha": outcome(lambda: differences(*built(lambda: nn.MultiheadAttention(8, 2)))),
        "trunc_normal": outcome(lambda: differences(*built(Reinit))),
        "twin": outcome(twin),
        "write_outside": write_outside(),
    }
    (out_dir / f"rank{rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
