"""Write the DeepSpeed checkpoint fixtures with a real DeepSpeed (not run by the tests).

Regenerate (from the repository root; about a minute on two cores)::

    bench/.venv-ds/bin/python tests/data/deepspeed_ckpt/make.py

It needs an interpreter that imports ``deepspeed`` (0.19.8 wrote the
committed fixtures) and starts, per fixture of :data:`model.FIXTURES`, two
CPU ranks on gloo (loopback). Each rank:

1. builds :class:`model.Tiny` and a DeepSpeed engine (AdamW, WarmupDecayLR,
   the fixture's ZeRO stage and precision), trains ``SAVE_AFTER`` steps and
   saves ``NAME/`` with a ``client_state``; DeepSpeed's recovery scripts
   it copies there are removed (the fixtures are data);
2. records what DeepSpeed itself says the checkpoint holds, through its own
   API on the live engine: the fp32 master and Adam moments of every
   trained parameter (``safe_get_full_fp32_param`` /
   ``safe_get_full_optimizer_state``), the frozen parameter and buffer,
   the optimizer's ``step`` and hyperparameters, the LR scheduler, the
   loss scaler and the counters -> ``NAME/expected.pt`` (plain tensors and
   numbers), the oracle of the importer's unit tests;
3. builds a fresh engine, ``load_checkpoint(NAME)`` and trains
   ``CONTINUE`` more steps: the global mean loss and the loss scale of each
   step go to ``oracle.json``, what dsrun must reproduce after importing.

``make.py stage1_fp16`` remakes one fixture; ``make.py --rank R --name NAME``
is one rank of one (with ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ... set).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import model as spec  # noqa: E402 - the directory is put on the path first

TIMEOUT_S = 600


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def rank_env(rank: int, port: int) -> dict[str, str]:
    return {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(spec.WORLD), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
            "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}


def drive(names: list[str]) -> None:
    oracle_path = HERE / "oracle.json"
    oracle = json.loads(oracle_path.read_text()) if oracle_path.exists() else {}
    for name in names:
        shutil.rmtree(HERE / name, ignore_errors=True)
        port = free_port()
        procs = [subprocess.Popen([sys.executable, __file__, "--rank", str(r), "--name", name],
                                  env=rank_env(r, port))
                 for r in range(spec.WORLD)]
        codes = [p.wait(TIMEOUT_S) for p in procs]
        if any(codes):
            raise SystemExit(f"{name}: ranks exited with {codes}")
        oracle[name] = json.loads((HERE / name / "oracle.json").read_text())
        (HERE / name / "oracle.json").unlink()
        add_offline_views(HERE / name, spec.FIXTURES[name][0])
        print(f"{name}: losses after the resume {oracle[name]['losses']}")
    oracle_path.write_text(json.dumps(oracle, indent=1, sort_keys=True) + "\n")


def add_offline_views(ckpt: Path, stage: int) -> None:
    """Into ``expected.pt``: DeepSpeed's offline views of the checkpoint -
    ``zero_to_fp32``'s consolidated state dict and, per trained parameter,
    the moments ``ds_to_universal`` extracts (stages 1-3; at stage 0 the
    live torch optimizer's state was recorded)."""
    import tempfile

    import torch

    facts = torch.load(ckpt / "expected.pt", weights_only=False)
    tag = (ckpt / "latest").read_text().strip()
    facts["zero_to_fp32"] = None  # stage 0: DeepSpeed's tool refuses it (the module is the model)
    if stage > 0:
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        try:
            consolidated = get_fp32_state_dict_from_zero_checkpoint(str(ckpt), tag)
            facts["zero_to_fp32"] = {k: v.clone() for k, v in consolidated.items()}
        except ValueError as exc:  # BF16_Optimizer's files: "is not a zero checkpoint"
            print(f"{ckpt.name}: zero_to_fp32 refuses it ({exc}); ds_to_universal only")
        with tempfile.TemporaryDirectory() as tmp:
            subprocess.run([sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal",
                            "--input_folder", str(ckpt / tag), "--output_folder", tmp,
                            "--num_extract_workers", "1", "--num_merge_workers", "1",
                            "--inject_missing_state"], check=True, env=rank_env(0, 0),
                           stdout=subprocess.DEVNULL)
            for name, entry in facts["params"].items():
                if "fp32" not in entry:
                    continue
                folder = Path(tmp, "zero", name)
                if not torch.equal(universal(folder, "fp32", entry), entry["fp32"]):
                    raise SystemExit(f"{name}: ds_to_universal and the live engine disagree")
                for key in ("exp_avg", "exp_avg_sq"):
                    entry[key] = universal(folder, key, entry)
                if (folder / "step.pt").exists():  # stage 3: facts["step"] only
                    entry["step"] = float(torch.load(folder / "step.pt", weights_only=False))
    torch.save(facts, ckpt / "expected.pt")


def universal(folder: Path, key: str, entry: dict[str, Any]) -> Any:
    """One tensor ``ds_to_universal`` wrote (stages 1-2: ``{"param": ...}``,
    stage 3: the tensor), in the parameter's shape."""
    import torch

    value = torch.load(folder / f"{key}.pt", weights_only=False)
    value = value["param"] if isinstance(value, dict) else value
    return value.reshape(entry["fp32"].shape)


def mean_loss(loss: Any) -> float:
    import torch.distributed as dist

    value = loss.detach().float().clone()
    dist.all_reduce(value)
    return float(value) / dist.get_world_size()


def engine_for(stage: int, precision: str) -> Any:
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    # DeepSpeed's CPU accelerator refuses fp16 unless oneDNN has fp16 kernels;
    # torch computes fp16 on any CPU (slowly), which is all a fixture needs
    get_accelerator().is_fp16_supported = lambda: True
    module = spec.build()
    engine, *_ = deepspeed.initialize(model=module,
                                      model_parameters=spec.param_groups(module, stage),
                                      config=spec.config(stage, precision, spec.WORLD))
    return engine


def train(engine: Any, steps: int, precision: str) -> list[tuple[float, float]]:
    import torch.distributed as dist

    out = []
    for _ in range(steps):
        x, y = spec.batch(engine.global_steps, dist.get_rank(), spec.WORLD, precision)
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        scale = float(getattr(engine.optimizer, "cur_scale", 1.0))
        out.append((mean_loss(loss), scale))
    return out


def scaler_state(engine: Any) -> dict[str, Any] | None:
    scaler = getattr(engine.optimizer, "loss_scaler", None)
    if scaler is None or not hasattr(scaler, "cur_scale"):
        return None
    keys = ("cur_scale", "cur_iter", "last_overflow_iter", "cur_hysteresis", "delayed_shift",
            "scale_window", "min_scale", "dynamic")
    return {k: getattr(scaler, k) for k in keys if hasattr(scaler, k)}


def expected(engine: Any) -> dict[str, Any]:
    """What DeepSpeed's own API says the saved state is (module docstring, step 2)."""
    import torch
    from deepspeed.utils import safe_get_full_fp32_param

    params: dict[str, Any] = {}
    # stage 0 fp32: the torch optimizer itself (DeepSpeed's wrappers are no torch optimizers)
    live = engine.optimizer if isinstance(engine.optimizer, torch.optim.Optimizer) else None
    for name, p in engine.module.named_parameters():
        if p.requires_grad:
            if live is None:
                params[name] = {"fp32": safe_get_full_fp32_param(p).clone()}
            else:  # stage 0 fp32: the torch optimizer steps the parameter itself
                state = live.state[p]
                params[name] = dict(fp32=p.detach().clone(), exp_avg=state["exp_avg"].clone(),
                                    exp_avg_sq=state["exp_avg_sq"].clone(),
                                    step=float(state["step"]))
        else:  # frozen: its own value (at stage 3 gathered)
            import deepspeed

            with deepspeed.zero.GatheredParameters([p], enabled=hasattr(p, "ds_id")):
                params[name] = {"value": p.detach().clone()}
    inner = engine.optimizer.optimizer if hasattr(engine.optimizer, "optimizer") \
        else engine.optimizer
    steps = [float(s["step"]) for s in inner.state.values() if "step" in s]
    groups = [{k: v for k, v in g.items() if k != "params"} for g in inner.param_groups]
    return {"params": params,
            "buffers": {n: b.detach().clone() for n, b in engine.module.named_buffers()},
            "step": steps, "param_groups": groups,
            "lr_scheduler": engine.lr_scheduler.state_dict(), "loss_scaler": scaler_state(engine),
            "global_steps": engine.global_steps, "global_samples": engine.global_samples,
            "skipped_steps": engine.skipped_steps,
            "torch": torch.__version__}


def rank_main(rank: int, name: str) -> None:
    import deepspeed
    import torch
    import torch.distributed as dist

    deepspeed.init_distributed("gloo")
    stage, precision = spec.FIXTURES[name]
    out = HERE / name
    engine = engine_for(stage, precision)
    train(engine, spec.SAVE_AFTER, precision)
    client = {"epoch": 3, "note": "client state of make.py", "best": torch.tensor([0.25, 0.5])}
    engine.save_checkpoint(str(out), client_state=client)
    facts = expected(engine)
    if rank == 0:
        for script in ("zero_to_fp32.py", "zero_to_torch.py"):
            (out / script).unlink(missing_ok=True)
        facts["client_state"] = client
        facts["deepspeed"] = deepspeed.__version__
        torch.save(facts, out / "expected.pt")
    dist.barrier()
    resumed = engine_for(stage, precision)
    resumed.load_checkpoint(str(out))
    after = train(resumed, spec.CONTINUE, precision)
    if rank == 0:
        (out / "oracle.json").write_text(json.dumps({
            "start": spec.SAVE_AFTER, "losses": [a for a, _ in after],
            "loss_scale": [s for _, s in after], "deepspeed": deepspeed.__version__,
            "torch": torch.__version__}))
    dist.barrier()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", default=list(spec.FIXTURES))
    parser.add_argument("--rank", type=int)
    parser.add_argument("--name")
    args = parser.parse_args()
    if args.rank is None:
        drive(args.names)
    else:
        rank_main(args.rank, args.name)


if __name__ == "__main__":
    main()
