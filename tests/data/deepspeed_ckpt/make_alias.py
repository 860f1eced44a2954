"""Write the DeepSpeed fixtures of a model holding one submodule under three names.

Regenerate (from the repository root; about a minute on two cores)::

    bench/.venv-ds/bin/python tests/data/deepspeed_ckpt/make_alias.py

Like make.py (whose helpers it uses: two CPU ranks on gloo, AdamW and
WarmupDecayLR, ``SAVE_AFTER`` steps, then a resume and ``CONTINUE`` more),
over :class:`Aliased`: its ``Block`` (a Linear and a persistent buffer) is
reached as ``block``, ``blocks["0"]`` and ``also``. DeepSpeed 0.19.8's
``shared_params`` names ``blocks.0.*`` but not ``also.*`` (it walks
``named_children()``, which skips a module already seen under the same
parent), while the saved module state dict lists all three names.

Each ``NAME/expected.pt`` holds, from the live engine: ``state_dict_keys``
(the module's), ``values`` (every name of the state dict: a trained
parameter's fp32 master, a frozen one's or a buffer's value),
``zero_to_fp32`` (DeepSpeed's consolidation of the checkpoint, which drops
``also.*``) and ``losses`` (the global mean loss of each step after
DeepSpeed's own resume).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import make  # noqa: E402 - the directory is put on the path first
import model as spec  # noqa: E402

FIXTURES: dict[str, tuple[int, str]] = {
    "alias_stage2_fp16": (2, "fp16"),
    "alias_stage3_fp32": (3, "fp32"),
}


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(spec.HIDDEN, spec.HIDDEN)
        self.register_buffer("gain", torch.linspace(0.5, 1.5, spec.HIDDEN))


class Aliased(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(spec.FEATURES, spec.HIDDEN)
        self.block = Block()
        self.blocks = torch.nn.ModuleDict({"0": self.block})
        self.also = self.block  # a third name DeepSpeed's shared_params leaves out
        self.fc3 = torch.nn.Linear(spec.HIDDEN, spec.OUT)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        dtype = self.fc1.weight.dtype
        h = torch.relu(self.fc1(x.to(dtype)))
        h = torch.tanh(self.also.lin(h)) * self.block.gain
        out = self.fc3(h.to(dtype))
        return torch.nn.functional.mse_loss(out.float(), y.float())


def build() -> Aliased:
    torch.manual_seed(spec.SEED)
    return Aliased()


def engine_for(stage: int, precision: str) -> Any:
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    get_accelerator().is_fp16_supported = lambda: True  # as make.py
    module = build()
    engine, *_ = deepspeed.initialize(model=module,
                                      model_parameters=spec.param_groups(module, stage),
                                      config=spec.config(stage, precision, spec.WORLD))
    return engine


def values(engine: Any) -> dict[str, torch.Tensor]:
    """Every state-dict name's value (module docstring): masters, buffers."""
    from deepspeed.utils import safe_get_full_fp32_param

    out = {}
    for name, p in engine.module.named_parameters(remove_duplicate=False):
        out[name] = safe_get_full_fp32_param(p).clone()
    for name, b in engine.module.named_buffers(remove_duplicate=False):
        out[name] = b.detach().clone()
    return out


def rank_main(rank: int, name: str) -> None:
    import deepspeed
    import torch.distributed as dist

    deepspeed.init_distributed("gloo")
    stage, precision = FIXTURES[name]
    out = HERE / name
    engine = engine_for(stage, precision)
    make.train(engine, spec.SAVE_AFTER, precision)
    engine.save_checkpoint(str(out))
    facts = {"state_dict_keys": list(engine.module.state_dict().keys()),
             "values": values(engine), "deepspeed": deepspeed.__version__}
    if rank == 0:
        for script in ("zero_to_fp32.py", "zero_to_torch.py"):
            (out / script).unlink(missing_ok=True)
    dist.barrier()
    resumed = engine_for(stage, precision)
    resumed.load_checkpoint(str(out))
    facts["losses"] = [loss for loss, _ in make.train(resumed, spec.CONTINUE, precision)]
    if rank == 0:
        torch.save(facts, out / "expected.pt")
    dist.barrier()


def drive(names: list[str]) -> None:
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    for name in names:
        shutil.rmtree(HERE / name, ignore_errors=True)
        port = make.free_port()
        procs = [subprocess.Popen([sys.executable, __file__, "--rank", str(r), "--name", name],
                                  env=make.rank_env(r, port))
                 for r in range(spec.WORLD)]
        codes = [p.wait(make.TIMEOUT_S) for p in procs]
        if any(codes):
            raise SystemExit(f"{name}: ranks exited with {codes}")
        facts = torch.load(HERE / name / "expected.pt", weights_only=False)
        consolidated = get_fp32_state_dict_from_zero_checkpoint(str(HERE / name))
        facts["zero_to_fp32"] = {k: v.clone() for k, v in consolidated.items()}
        torch.save(facts, HERE / name / "expected.pt")
        print(f"{name}: losses after the resume {json.dumps(facts['losses'])}")


def main() -> None:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", default=list(FIXTURES))
    parser.add_argument("--rank", type=int)
    parser.add_argument("--name")
    args = parser.parse_args()
    if args.rank is None:
        drive(args.names)
    else:
        rank_main(args.rank, args.name)


if __name__ == "__main__":
    main()
