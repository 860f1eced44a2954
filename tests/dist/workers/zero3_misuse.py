"""Uses of ZeRO-3 partitioned parameters that cannot work, and what each
says, in one 2-rank dsrun job (fp32, every parameter partitioned:
``stage3_param_persistence_threshold`` 0); each rank writes
``OUT_DIR/rank<R>.json`` and tests/dist/test_zero3_misuse.py judges:

* **compiled**: a module compiled before ``initialize()`` -
  ``torch.compile(model)``, a compiled child, ``model.compile()`` - once
  died at the first forward with a bare IndexError from dynamo tracing the
  fetch hooks; ``compiled_whole``: the same with every parameter kept whole
  (no hooks) trains;
* **spectral_norm**: the old ``torch.nn.utils.spectral_norm`` under
  ``zero.Init`` once reshaped the released weight to ``(8, 0)`` and built
  another model silently; ``spectral_norm_outside``: built outside and
  given to ``zero.Init(module=...)``, the eval output equals plain torch's;
* **load_state_dict** into ``engine.module`` after ``initialize()`` (the
  error once said ``[6, 4]`` did not match ``[6, 4]``), then inside
  ``GatheredParameters(modifier_rank=0)``, where it loads;
* **deepcopy** of ``engine.module`` (once: parameters without data), then
  inside ``GatheredParameters``, where the copy computes what the engine
  does and its forward (with the hooks it copied) gathers nothing of the
  engine's;
* **reshape** of a released parameter outside a gather.

Usage: ``dsrun --cpu --num_gpus 2 zero3_misuse.py OUT_DIR``.
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
from dsrun.runtime.zero import fetch


def config(threshold: int = 0) -> dict[str, Any]:
    return {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 0.0,
            "zero_allow_untested_optimizer": True,
            "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
            "zero_optimization": {"stage": 3,
                                  "stage3_param_persistence_threshold": threshold}}


def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3))


def outcome(run: Callable[[], Any]) -> dict[str, Any]:
    try:
        return {"ok": run()}
    except Exception as err:  # noqa: BLE001 - the error is the result
        return {"error": type(err).__name__, "message": str(err),
                "dsrun": isinstance(err, DsrunError)}


def train(model: nn.Module, threshold: int = 0) -> list[float]:
    engine, *_ = deepspeed.initialize(model=model, config=config(threshold),
                                      model_parameters=model.parameters())
    losses = []
    for step in range(2):
        loss = engine(torch.full((2, 4), 0.1 * (step + 1))).pow(2).mean()
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def compiled_child() -> nn.Module:
    model = mlp()
    model[2] = torch.compile(model[2], backend="eager")
    return model


def compiled_in_place() -> nn.Module:
    model = mlp()
    model.compile(backend="eager")
    return model


class SpectralNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l = nn.utils.spectral_norm(nn.Linear(8, 8))
        self.head = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.l(x))


def spectral_in_init() -> Any:
    with deepspeed.zero.Init(config_dict_or_path=config()):
        SpectralNet()


def spectral_outside() -> Any:
    torch.manual_seed(0)
    plain = SpectralNet().eval()
    torch.manual_seed(0)
    model = SpectralNet()
    deepspeed.zero.Init(module=model, config_dict_or_path=config())
    engine, *_ = deepspeed.initialize(model=model, config=config(),
                                      model_parameters=model.parameters())
    engine.eval()
    x = torch.linspace(-1, 1, 24).view(3, 8)
    with torch.no_grad():
        return [engine(x).tolist(), plain(x).tolist()]


def engine_of_mlp() -> tuple[Any, nn.Sequential]:
    model = mlp()
    engine, *_ = deepspeed.initialize(model=model, config=config(),
                                      model_parameters=model.parameters())
    return engine, model


def load_state() -> dict[str, Any]:
    engine, model = engine_of_mlp()
    new = {k: torch.full(v.shape, 0.5) for k, v in mlp().state_dict().items()}
    out = {"outside": outcome(lambda: str(model.load_state_dict(new)))}
    with deepspeed.zero.GatheredParameters(list(model.parameters()), modifier_rank=0):
        model.load_state_dict(new)
    with deepspeed.zero.GatheredParameters(list(model.parameters())):
        out["loaded"] = sorted({v for p in model.parameters() for v in p.flatten().tolist()})
    return out


def deep_copy() -> dict[str, Any]:
    engine, model = engine_of_mlp()
    out = {"outside": outcome(lambda: str(copy.deepcopy(model)))}
    with deepspeed.zero.GatheredParameters(list(model.parameters())):
        twin = copy.deepcopy(model)
    x = torch.full((2, 4), 0.3)
    gathers: list[int] = []
    start = fetch.start_gathers  # counted: the copy kept the engine's hooks (functions)

    def counted(params: Any, strategy: Any = None) -> None:
        gathers.append(len(params))
        start(params, strategy)

    fetch.start_gathers = counted
    try:
        with torch.no_grad():
            out["twin"] = twin(x).tolist()
    finally:
        fetch.start_gathers = start
    out["gathers_by_twin"] = len(gathers)
    with torch.no_grad():
        out["engine"] = engine(x).tolist()
    return out


def reshape() -> dict[str, Any]:
    _, model = engine_of_mlp()
    weight = model[0].weight
    out = {"outside": outcome(lambda: weight.reshape(6, -1).shape)}
    with deepspeed.zero.GatheredParameters([weight]):
        out["gathered"] = list(weight.reshape(6, -1).shape)
    return out


def main() -> None:
    deepspeed.init_distributed(dist_backend="gloo")
    out_dir = Path(sys.argv[1])
    rank = dist.get_rank()
    result = {
        "rank": rank,
        "compiled": outcome(lambda: train(torch.compile(mlp(), backend="eager"))),
        "compiled_child": outcome(lambda: train(compiled_child())),
        "compiled_in_place": outcome(lambda: train(compiled_in_place())),
        "compiled_whole": outcome(lambda: train(torch.compile(mlp(), backend="eager"),
                                                threshold=10 ** 6)),
        "spectral_norm": outcome(spectral_in_init),
        "spectral_norm_outside": outcome(spectral_outside),
        "load_state_dict": load_state(),
        "deepcopy": deep_copy(),
        "reshape": reshape(),
    }
    (out_dir / f"rank{rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
