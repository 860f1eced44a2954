"""Checkpoint cases on real gloo ranks; each run writes ``<out>/rank<R>.json``
(and ``.pt`` files of parameters) for tests/dist/test_checkpoint_*.py.

Modes (``--mode``):

* ``straight`` - for each stage of ``--stages``: a fresh engine (seed 0)
  trains ``--first`` optimizer steps from the engine's dataloader, saves
  ``CKPT/stage<S>``, trains ``--then`` more; records the losses, lrs and
  batches of the last ``--then`` steps and the final parameters. Then the
  extra cases of a 2-rank job (``--extras``): tag disagreement, async save
  vs sync save, consolidation, 16-bit model, and last (it leaves the
  coordinator unusable) a save called on rank 0 only.
* ``resume`` - for each stage: an engine built with another seed loads
  ``CKPT/stage<S>`` and trains ``--then`` steps; the same records.
* ``reshard`` - global batches fixed per step (whatever the world size),
  no dropout; for each ``--run STAGE[:load=TAG][:save=TAG]``: an engine at
  that stage trains ``--first + --then`` steps saving TAG after ``--first``,
  or loads TAG and trains ``--then``; records the global mean loss per step.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import errno
import json
import os
import threading
import time
import traceback
from typing import Any, Optional

import torch
import torch.distributed as dist

import dsrun
from dsrun.errors import CheckpointError
from dsrun.runtime.checkpoint.settings import PausePoint

FEATURES, HIDDEN, CLASSES = 12, 24, 5
SAMPLES = 64


class Net(torch.nn.Module):
    def __init__(self, dropout: float) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(FEATURES, HIDDEN)
        self.mid = torch.nn.Linear(HIDDEN, HIDDEN)
        self.out = torch.nn.Linear(HIDDEN, CLASSES)
        self.drop = torch.nn.Dropout(dropout)
        self.offset = torch.nn.Parameter(torch.randn(HIDDEN) * 0.1, requires_grad=False)
        self.register_buffer("scale", torch.tensor(0.5))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x)) + self.offset
        h = self.drop(torch.tanh(self.mid(h)) * (1 + self.scale))
        return torch.nn.functional.cross_entropy(self.out(h), y)


def dataset() -> torch.utils.data.TensorDataset:
    gen = torch.Generator().manual_seed(123)
    y = torch.randint(0, CLASSES, (SAMPLES,), generator=gen)
    x = torch.randn(SAMPLES, FEATURES, generator=gen) * 0.5
    x[torch.arange(SAMPLES), y] += 1.5
    return torch.utils.data.TensorDataset(x, y)


def config(stage: int, micro: int, gas: int = 2, **extra: Any) -> dict[str, Any]:
    return {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": gas,
            "optimizer": {"type": "AdamW", "params": {"lr": 3e-2, "weight_decay": 0.01}},
            "scheduler": {"type": "WarmupDecayLR",
                          "params": {"warmup_num_steps": 3, "total_num_steps": 30,
                                     "warmup_max_lr": 3e-2}},
            "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 20,
                                  "stage3_gather_16bit_weights_on_model_save": True},
            "steps_per_print": 1000, **extra}


def build(stage: int, seed: int, dropout: float = 0.1, micro: int = 4, **extra: Any) -> Any:
    torch.manual_seed(seed)
    engine, _, loader, _ = dsrun.initialize(model=Net(dropout), training_data=dataset(),
                                            config=config(stage, micro, **extra))
    return engine, loader


def full_params(engine: Any) -> dict[str, torch.Tensor]:
    """The full parameters, on the CPU (whatever device the rank uses)."""
    state = engine.optimizer.module_state_dict() if engine.zero_stage == 3 else \
        engine.module.state_dict()
    return {k: v.detach().cpu().clone() for k, v in state.items()}


class Batches:
    """Micro-batches from the engine's dataloader, starting new epochs."""

    def __init__(self, loader: Any) -> None:
        self.loader, self.it = loader, iter(loader)

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        try:
            return next(self.it)
        except StopIteration:
            self.it = iter(self.loader)
            return next(self.it)


def train(engine: Any, batches: Batches, steps: int) -> dict[str, list[Any]]:
    losses, lrs, seen = [], [], []
    for _ in range(steps * engine.gradient_accumulation_steps()):
        x, y = batches.next()
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item().hex())
        seen.append(float(x.sum()))
        lrs.append(engine.get_lr()[0])
    return {"losses": losses, "lrs": lrs, "batches": seen}


def stage_runs(args: argparse.Namespace, out: dict[str, Any]) -> None:
    rank = dist.get_rank()
    for stage in args.stages:
        ckpt = os.path.join(args.ckpt, f"stage{stage}")
        if args.mode == "straight":
            engine, loader = build(stage, seed=0)
            batches = Batches(loader)
            train(engine, batches, args.first)
            engine.save_checkpoint(ckpt, client_state={"stage": stage, "note": [1, 2]})
            record = train(engine, batches, args.then)
            record["client_state"] = None
        else:
            engine, loader = build(stage, seed=1000 + stage)
            path, client = engine.load_checkpoint(ckpt)
            samples_at_load = engine.global_samples
            record = train(engine, Batches(loader), args.then)
            record.update(path=path, client_state=client, samples_at_load=samples_at_load)
        record["global_steps"] = engine.global_steps
        record["global_samples"] = engine.global_samples
        torch.save(full_params(engine), os.path.join(args.out, f"params_s{stage}_r{rank}.pt"))
        out[f"stage{stage}"] = record
        engine.destroy()


# --------------------------------------------------------------- extras


def case(out: dict[str, Any], name: str, fn: Any, *args: Any) -> None:
    try:
        out[name] = {"ok": True, **fn(*args)}
    except Exception:  # noqa: BLE001 - the test reads the traceback
        out[name] = {"ok": False, "error": traceback.format_exc()}


def tag_mismatch(args: argparse.Namespace) -> dict[str, Any]:
    engine, loader = build(1, seed=0)
    train(engine, Batches(loader), 1)
    try:
        engine.save_checkpoint(os.path.join(args.ckpt, "mismatch"), tag=f"t{dist.get_rank()}")
    except CheckpointError as exc:
        return {"error_text": str(exc)}
    return {"error_text": None}


def async_vs_sync(args: argparse.Namespace) -> dict[str, Any]:
    root = os.path.join(args.ckpt, "async")
    engine, loader = build(3, seed=0, checkpoint={"async": True})
    batches = Batches(loader)
    train(engine, batches, 2)
    engine.save_checkpoint(root, tag="first")  # async: the next save waits for it
    settings = engine._checkpointer.settings
    engine._checkpointer.settings = dataclasses.replace(settings, async_save=False)
    engine.save_checkpoint(root, tag="sync")
    engine._checkpointer.settings = settings
    engine.save_checkpoint(root, tag="async")
    train(engine, batches, 2)  # changes every parameter while the save may still be writing
    engine.destroy()  # waits for the save, raises its failure
    return {}


def saved_async(args: argparse.Namespace, name: str, stage: int, tag: str
                ) -> tuple[str, Any, Batches]:
    """An asynchronous-saving engine at ``stage`` that trained one step and
    saved ``tag`` under ``args.ckpt/name``, the save waited for."""
    root = os.path.join(args.ckpt, name)
    engine, loader = build(stage, seed=0, checkpoint={"async": True})
    batches = Batches(loader)
    train(engine, batches, 1)
    engine.save_checkpoint(root, tag=tag)
    engine.wait_for_checkpoint()
    return root, engine, batches


def async_then_latest(args: argparse.Namespace) -> dict[str, Any]:
    """An asynchronous save, then at once ``load_checkpoint`` without a tag
    (and ``wait_for_checkpoint``): rank 0 is held before it writes
    ``latest``, so a rank that read ``latest`` without waiting for rank 0's
    commit would find the old tag."""
    root, engine, batches = saved_async(args, "async_latest", 1, "first")
    seen = {"after_wait": open(os.path.join(root, "latest")).read()}
    ck = engine._checkpointer
    release = os.path.join(args.ckpt, "async_latest_release")
    if dist.get_rank() == 0:
        ck.settings = dataclasses.replace(ck.settings, pause=PausePoint(
            0, "latest", release=release, tag="second"))
        threading.Timer(1.5, lambda: open(release, "w").close()).start()
    train(engine, batches, 1)
    engine.save_checkpoint(root, tag="second")
    path, _ = engine.load_checkpoint(root)
    seen["loaded"] = os.path.basename(path)
    engine.save_checkpoint(root, tag="third")
    engine.wait_for_checkpoint()
    seen["latest_after_wait"] = open(os.path.join(root, "latest")).read()
    engine.destroy()
    return seen


def consolidation(args: argparse.Namespace) -> dict[str, Any]:
    engine, loader = build(3, seed=0)
    train(engine, Batches(loader), 2)
    root = os.path.join(args.ckpt, "consolidate")
    engine.save_checkpoint(root, tag="c")
    full = full_params(engine)
    saved16 = engine.save_16bit_model(os.path.join(args.ckpt, "model16"), "model.bin")
    consolidated = engine._zero3_consolidated_16bit_state_dict()
    if dist.get_rank() == 0:
        torch.save(full, os.path.join(args.out, "consolidate_full.pt"))
        torch.save(consolidated, os.path.join(args.out, "consolidated16.pt"))
    return {"saved16": saved16, "consolidated": consolidated is not None}


def only_rank0(args: argparse.Namespace) -> dict[str, Any]:
    engine, loader = build(0, seed=0, checkpoint={"timeout": 3})
    train(engine, Batches(loader), 1)
    text = None
    if dist.get_rank() == 0:
        try:
            engine.save_checkpoint(os.path.join(args.ckpt, "only0"))
        except CheckpointError as exc:
            text = str(exc)
    dist.barrier()
    return {"error_text": text}


def async_disk_full(args: argparse.Namespace) -> dict[str, Any]:
    """An asynchronous save whose data file hits a full disk on rank 1 (the
    default checkpoint.timeout of 600 s): the next save must raise rank 1's
    error at once, on both ranks."""
    from dsrun.runtime.checkpoint import storage

    root, engine, batches = saved_async(args, "async_full", 2, "good")
    real = storage.write_all

    def full(fd: int, data: memoryview) -> None:
        raise storage.WriteFailed(OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)), 0)

    if dist.get_rank() == 1:
        storage.write_all = full
    text, start = None, time.monotonic()
    try:
        engine.save_checkpoint(root, tag="bad")
        train(engine, batches, 1)
        engine.save_checkpoint(root, tag="next")
    except CheckpointError as exc:
        text = str(exc)
    finally:
        storage.write_all = real
    seconds = time.monotonic() - start
    dist.barrier()
    engine.destroy()
    return {"error_text": text, "seconds": seconds, "listing": sorted(os.listdir(root)),
            "latest": open(os.path.join(root, "latest")).read()}


def async_commit_fails(args: argparse.Namespace) -> dict[str, Any]:
    """An asynchronous save whose commit (rank 0 alone renames TAG.tmp/)
    fails after rank 1's write succeeded: ``wait_for_checkpoint`` must raise
    rank 0's error on rank 1 too."""
    from dsrun.runtime.checkpoint import writer

    root = os.path.join(args.ckpt, "async_commit")
    engine, loader = build(1, seed=0, checkpoint={"async": True})
    train(engine, Batches(loader), 1)
    real = writer.replace_dir

    def broken(tmp: str, final: str) -> None:
        raise OSError(errno.EIO, "injected commit failure")

    if dist.get_rank() == 0:
        writer.replace_dir = broken
    text = None
    try:
        engine.save_checkpoint(root, tag="bad")
        engine.wait_for_checkpoint()
    except CheckpointError as exc:
        text = str(exc)
    finally:
        writer.replace_dir = real
    dist.barrier()
    engine.destroy()
    return {"error_text": text}


class Scaled(Net):
    """Net times a learned 0-d scale."""

    def __init__(self) -> None:
        super().__init__(0.0)
        self.gain = torch.nn.Parameter(torch.tensor(1.5))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return super().forward(x, y) * self.gain


def engine_of(model: torch.nn.Module, stage: int, seed: int) -> Any:
    torch.manual_seed(seed)
    engine, _, loader, _ = dsrun.initialize(model=model, training_data=dataset(),
                                            config=config(stage, 4))
    return engine, loader


def scalar_param(args: argparse.Namespace) -> dict[str, Any]:
    """A 0-d parameter's Adam moments saved at stage 0, loaded at stages 1-3."""
    root = os.path.join(args.ckpt, "scalar")
    engine, loader = engine_of(Scaled(), 0, seed=0)
    batches = Batches(loader)
    train(engine, batches, 2)
    engine.save_checkpoint(root, tag="t")
    out = {"expected": train(engine, batches, 2)["losses"], "loaded": {}}
    engine.destroy()
    for stage in (1, 2, 3):
        other, loader = engine_of(Scaled(), stage, seed=5)
        other.load_checkpoint(root, tag="t")
        out["loaded"][stage] = train(other, Batches(loader), 2)["losses"]
        other.destroy()
    return out


def unfreeze(args: argparse.Namespace) -> dict[str, Any]:
    """Parameters frozen when saved, trainable when loaded (fine-tuning)."""
    out = {}
    for stage in (2, 3):
        root = os.path.join(args.ckpt, f"unfreeze{stage}")
        model = Net(0.0)
        model.inp.requires_grad_(False)
        engine, loader = engine_of(model, stage, seed=0)
        train(engine, Batches(loader), 1)
        engine.save_checkpoint(root, tag="t")
        other, loader = engine_of(Net(0.0), stage, seed=7)
        other.load_checkpoint(root, tag="t")
        record = train(other, Batches(loader), 1)
        out[stage] = [float.fromhex(v) for v in record["losses"]]
        engine.destroy()
        other.destroy()
    return out


def snapshot(engine: Any) -> list[torch.Tensor]:
    values = [v.clone() for v in full_params(engine).values()]
    for state in engine.optimizer.optimizer.state.values():
        values.extend(v.clone() for v in state.values() if isinstance(v, torch.Tensor))
    return values


def refused_on_one_rank(args: argparse.Namespace) -> dict[str, Any]:
    """The optimizer refuses the loaded state on rank 1 only: every rank
    raises the same error and nothing changed."""
    root = os.path.join(args.ckpt, "refused")
    engine, loader = build(2, seed=0)
    train(engine, Batches(loader), 1)
    engine.save_checkpoint(root, tag="t")
    before = snapshot(engine)
    original = torch.optim.AdamW.__setstate__

    def refuse(self: Any, state: Any) -> None:
        raise KeyError("step")

    if dist.get_rank() == 1:
        torch.optim.AdamW.__setstate__ = refuse  # type: ignore[method-assign]
    try:
        engine.load_checkpoint(root, tag="t")
        text = None
    except CheckpointError as exc:
        text = str(exc)
    finally:
        torch.optim.AdamW.__setstate__ = original  # type: ignore[method-assign]
    after = snapshot(engine)
    same = len(before) == len(after) and all(torch.equal(a, b) for a, b in zip(before, after))
    train(engine, Batches(loader), 1)  # still usable
    engine.destroy()
    return {"error_text": text, "unchanged": same}


def refused_arguments(args: argparse.Namespace) -> dict[str, Any]:
    """A client_state that is not a dict on rank 1 only, then a tag too long
    for the file system: every rank raises the same error, nothing is
    written, and the engine saves afterwards."""
    root = os.path.join(args.ckpt, "refused_arguments")
    engine, loader = build(1, seed=0)
    train(engine, Batches(loader), 1)
    texts: list[Optional[str]] = []
    for tag, client in (("t", [1, 2] if dist.get_rank() == 1 else {"a": 1}), ("x" * 250, None)):
        try:
            engine.save_checkpoint(root, tag=tag, client_state=client)
            texts.append(None)
        except CheckpointError as exc:
            texts.append(str(exc))
    engine.save_checkpoint(root, tag="ok")
    engine.destroy()
    return {"client_text": texts[0], "tag_text": texts[1]}


def extras(args: argparse.Namespace, out: dict[str, Any]) -> None:
    case(out, "tag_mismatch", tag_mismatch, args)
    case(out, "async_vs_sync", async_vs_sync, args)
    case(out, "async_then_latest", async_then_latest, args)
    case(out, "consolidation", consolidation, args)
    case(out, "scalar_param", scalar_param, args)
    case(out, "unfreeze", unfreeze, args)
    case(out, "refused_on_one_rank", refused_on_one_rank, args)
    case(out, "async_disk_full", async_disk_full, args)
    case(out, "async_commit_fails", async_commit_fails, args)
    case(out, "refused_arguments", refused_arguments, args)
    case(out, "only_rank0", only_rank0, args)  # last: the coordinator is unusable after it


# -------------------------------------------------------------- reshard


def global_batch(step: int, rank: int, world: int, micro: int, gas: int, index: int
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s micro-batch ``index`` of step ``step``: one slice of a
    global batch that is the same for every world size."""
    x, y = dataset().tensors
    order = torch.randperm(SAMPLES, generator=torch.Generator().manual_seed(step))[:12]
    start = (index * world + rank) * micro
    take = order[start:start + micro]
    return x[take], y[take]


def parse_run(spec: str) -> dict[str, Any]:
    """``STAGE[:load=TAG][:save=TAG]``."""
    stage, *rest = spec.split(":")
    run: dict[str, Any] = {"stage": int(stage), "load": None, "save": None}
    for part in rest:
        key, _, value = part.partition("=")
        run[key] = value
    return run


def reshard_run(args: argparse.Namespace, run: dict[str, Any]) -> dict[str, Any]:
    world, rank = dist.get_world_size(), dist.get_rank()
    gas = 2
    micro = 12 // (world * gas)
    engine, _ = build(run["stage"], seed=0 if run["load"] is None else 99, dropout=0.0,
                      micro=micro)
    start = 0
    if run["load"]:
        engine.load_checkpoint(args.ckpt, tag=run["load"])
        start = engine.global_steps
    steps = args.then if run["load"] else args.first + args.then
    losses = []
    for step in range(start, start + steps):
        if run["save"] and step == args.first:
            engine.save_checkpoint(args.ckpt, tag=run["save"])
        total = torch.zeros(())
        for index in range(gas):
            loss = engine(*global_batch(step, rank, world, micro, gas, index))
            engine.backward(loss)
            engine.step()
            total += loss.detach() / gas
        dist.all_reduce(total)
        losses.append(float(total) / world)
    engine.destroy()
    return {**run, "losses": losses, "start": start, "world": world}


def reshard(args: argparse.Namespace, out: dict[str, Any]) -> None:
    out["runs"] = [reshard_run(args, parse_run(spec)) for spec in args.run]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", required=True, choices=("straight", "resume", "reshard"))
    parser.add_argument("--out", required=True)
    parser.add_argument("--ckpt", required=True)
    parser.add_argument("--stages", type=lambda s: [int(v) for v in s.split(",")], default=[])
    parser.add_argument("--first", type=int, default=3)
    parser.add_argument("--then", type=int, default=4)
    parser.add_argument("--run", action="append", default=[],
                        help="reshard mode: STAGE[:load=TAG][:save=TAG], repeatable")
    parser.add_argument("--extras", action="store_true")
    args = parser.parse_args()
    if not dist.is_initialized():
        dsrun.init_distributed()
    out: dict[str, Any] = {"world_size": dist.get_world_size()}
    with contextlib.suppress(Exception):
        torch.set_num_threads(1)
    if args.mode == "reshard":
        reshard(args, out)
    else:
        stage_runs(args, out)
        if args.extras:
            extras(args, out)
    with open(os.path.join(args.out, f"rank{dist.get_rank()}.json"), "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main()
