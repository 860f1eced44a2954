"""Pipeline checkpoint cases on gloo ranks; each job writes ``<out>/rank<R>.json``
(and ``.pt`` files of parameters) for tests/dist/test_pipe_checkpoint.py.

Every run trains on the engine's dataloader (``training_data=``) with
global batches of 16 samples whatever the layout (micro-batches of 4;
4 per step with one replica, 2 with two), an LR schedule, clipping and
AdamW, so any layout follows the same loss curve up to rounding. Jobs
(``--job``):

* ``straight`` (2 ranks): 2 stages x 1 replica, ZeRO 0: for each pipeline
  case, train N=3 steps, save ``CKPT/<case>``, train M=4 more ("tied": also
  an asynchronous save of the same state into ``CKPT/tied-async``). Then a
  plain engine (``nn.Sequential`` with the "mlp" pipeline's names, 2
  data-parallel ranks) does the same into ``CKPT/plain``.
* ``resume`` (2 ranks, new processes): 2 stages, each case built from
  another seed, loads its checkpoint and trains M steps; the plain
  checkpoint loaded into the 2-stage "mlp" pipeline; a strict load of the
  "mlp" checkpoint into the "tied" pipeline (an error; nothing changed);
  last, a save called on rank 0 only.
* ``wide`` (4 ranks): 2 stages x 2 replicas, ZeRO 1: "tied" loads
  ``CKPT/tied``, trains M steps, saving ``CKPT/tied-wide`` after 2 of them.
* ``narrow`` (2 ranks): 1 stage x 2 replicas, ZeRO 2: "tied" loads
  ``CKPT/tied`` and trains M steps, then loads ``CKPT/tied-wide`` and
  trains 2; a plain engine (2 data-parallel ranks) loads ``CKPT/mlp``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import dsrun
from dsrun.errors import CheckpointError
from dsrun.pipe import LayerSpec, PipelineModule, TiedLayerSpec

FIRST, THEN = 3, 4
SAMPLES, MICRO, GLOBAL = 64, 4, 16
VOCAB, DIM, LENGTH = 11, 8, 6


class Affine(nn.Module):
    def __init__(self, fan_in: int, fan_out: int) -> None:
        super().__init__()
        self.linear = nn.Linear(fan_in, fan_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.linear(x))


class Double(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 2 * x


def double(x: torch.Tensor) -> torch.Tensor:
    return 2 * x


class Mixer(nn.Module):
    def __init__(self, dim: int, dropout: float) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(dim, 2 * dim), nn.Linear(2 * dim, dim)
        self.drop = nn.Dropout(dropout)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.drop(self.down(F.gelu(self.up(h))))


def logits(embedding: nn.Embedding, h: torch.Tensor) -> torch.Tensor:
    return h @ embedding.weight.t()


def token_loss(out: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.reshape(-1, VOCAB), targets.reshape(-1))


def tied_layers(dropout: float) -> list[Any]:
    """An embedding tied to the output layer across the stages."""
    return [TiedLayerSpec("embed", nn.Embedding, VOCAB, DIM), LayerSpec(Mixer, DIM, dropout),
            LayerSpec(Mixer, DIM, dropout), LayerSpec(nn.LayerNorm, DIM),
            TiedLayerSpec("embed", nn.Embedding, VOCAB, DIM, forward_fn=logits)]


def mlp_layers() -> list[Any]:
    return [LayerSpec(Affine, 6, 12), LayerSpec(Affine, 12, 9), double,
            LayerSpec(nn.Linear, 9, 9), nn.Tanh(), LayerSpec(nn.Linear, 9, 5)]


def plain_mlp() -> nn.Module:
    """The "mlp" pipeline's layers as one module, with the same names."""
    return nn.Sequential(Affine(6, 12), Affine(12, 9), Double(), nn.Linear(9, 9), nn.Tanh(),
                         nn.Linear(9, 5))


def token_data() -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(5)
    tokens = [torch.randint(0, VOCAB, (SAMPLES,), generator=g)]
    for _ in range(LENGTH):
        tokens.append((3 * tokens[-1] + 1) % VOCAB)
    seq = torch.stack(tokens, dim=1)
    return torch.utils.data.TensorDataset(seq[:, :-1], seq[:, 1:])


def class_data() -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(6)
    x = torch.randn(SAMPLES, 6, generator=g)
    return torch.utils.data.TensorDataset(x, (x @ torch.randn(6, 5, generator=g)).argmax(1))


@dataclasses.dataclass(frozen=True)
class Case:
    layers: Callable[[], list[Any]]
    loss_fn: Callable[[Any, Any], torch.Tensor]
    data: Callable[[], torch.utils.data.TensorDataset]
    config: dict[str, Any] = dataclasses.field(default_factory=dict)


CASES = {
    "tied-dropout": Case(lambda: tied_layers(0.1), token_loss, token_data),
    "tied": Case(lambda: tied_layers(0.0), token_loss, token_data),
    "mlp": Case(mlp_layers, F.cross_entropy, class_data),
    # the loss scale doubles every 2 steps: a resume must restore the scaler
    "mlp-fp16": Case(mlp_layers, F.cross_entropy, class_data,
                     {"fp16": {"enabled": True, "auto_cast": True,
                               "initial_scale_power": 8, "loss_scale_window": 2}}),
}


def config(replicas: int, zero: int, **extra: Any) -> dict[str, Any]:
    return {"train_micro_batch_size_per_gpu": MICRO,
            "gradient_accumulation_steps": GLOBAL // (MICRO * replicas),
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
            "scheduler": {"type": "WarmupDecayLR",
                          "params": {"warmup_num_steps": 3, "total_num_steps": 30,
                                     "warmup_max_lr": 1e-2}},
            "gradient_clipping": 1.0, "zero_optimization": {"stage": zero},
            "steps_per_print": 1000, **extra}


def pipeline(name: str, stages: int, zero: int, seed: int, **extra: Any) -> Any:
    torch.manual_seed(seed)
    case = CASES[name]
    module = PipelineModule(layers=case.layers(), num_stages=stages, loss_fn=case.loss_fn)
    replicas = dist.get_world_size() // stages
    engine, _, _, _ = dsrun.initialize(model=module, training_data=case.data(),
                                       config=config(replicas, zero, **case.config, **extra))
    return engine


def plain(seed: int) -> tuple[Any, Any]:
    torch.manual_seed(seed)
    engine, _, loader, _ = dsrun.initialize(model=plain_mlp(), training_data=class_data(),
                                            config=config(dist.get_world_size(), 0))
    return engine, loader


def params(engine: Any) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in engine.module.state_dict().items()}


def dump(out: str, name: str, engine: Any) -> None:
    torch.save(params(engine), os.path.join(out, f"{name}-rank{dist.get_rank()}.pt"))


def train(engine: Any, steps: int, save: Callable[[int], None] = lambda step: None
          ) -> dict[str, Any]:
    """``steps`` pipeline steps; ``save(step)`` runs before each."""
    losses, lrs, start = [], [], engine.global_steps
    for step in range(start, start + steps):
        save(step)
        losses.append(float(engine.train_batch()).hex())
        lrs.append(engine.get_lr()[0])
    return {"start": start, "losses": losses, "lrs": lrs, "global_steps": engine.global_steps,
            "stage": engine.stage_id, "replica": engine.grid.data_parallel_id,
            "loss_scale": engine.precision.loss_scale}


class Batches:
    def __init__(self, loader: Any) -> None:
        self.loader, self.it = loader, iter(loader)

    def next(self) -> Any:
        try:
            return next(self.it)
        except StopIteration:
            self.it = iter(self.loader)
            return next(self.it)


def train_plain(engine: Any, batches: Batches, steps: int) -> dict[str, Any]:
    """The global mean loss per step of a plain data-parallel engine."""
    losses, start = [], engine.global_steps
    gas = engine.gradient_accumulation_steps()
    for _ in range(steps):
        total = torch.zeros(())
        for _ in range(gas):
            x, y = batches.next()
            loss = F.cross_entropy(engine(x), y)
            engine.backward(loss)
            engine.step()
            total += loss.detach() / gas
        dist.all_reduce(total)
        losses.append(float(total / dist.get_world_size()).hex())
    return {"start": start, "losses": losses, "global_steps": engine.global_steps}


def run(out: dict[str, Any], name: str, fn: Callable[..., dict[str, Any]], *args: Any) -> None:
    """An unexpected error ends the job (and dsrun stops every rank): a rank
    that went on would wait for its failed pipeline peer."""
    out[name] = {"ok": True, **fn(*args)}


# ------------------------------------------------------------------ jobs


def straight_case(args: argparse.Namespace, name: str) -> dict[str, Any]:
    engine = pipeline(name, 2, 0, seed=0)
    train(engine, FIRST)
    engine.save_checkpoint(os.path.join(args.ckpt, name), client_state={"case": name})
    dump(args.out, f"{name}-saved", engine)
    if name == "mlp-fp16":  # the whole model's weights in fp16, from both stages
        engine.save_16bit_model(os.path.join(args.ckpt, "model16"), "model.bin")
    if name == "tied":  # the same state, saved asynchronously while training goes on
        ck = engine._checkpointer
        settings = ck.settings
        ck.settings = dataclasses.replace(settings, async_save=True)
        engine.save_checkpoint(os.path.join(args.ckpt, "tied-async"))
        ck.settings = settings
    record = train(engine, THEN)
    engine.destroy()  # waits for the asynchronous save
    dump(args.out, f"{name}-final", engine)
    return record


def straight_plain(args: argparse.Namespace) -> dict[str, Any]:
    engine, loader = plain(seed=0)
    batches = Batches(loader)
    train_plain(engine, batches, FIRST)
    engine.save_checkpoint(os.path.join(args.ckpt, "plain"))
    return train_plain(engine, batches, THEN)


def resume_case(args: argparse.Namespace, name: str) -> dict[str, Any]:
    engine = pipeline(name, 2, 0, seed=1000)
    path, client = engine.load_checkpoint(os.path.join(args.ckpt, name))
    record = train(engine, THEN)
    dump(args.out, f"{name}-resumed", engine)
    return {**record, "path": path, "client_state": client}


def plain_into_pipeline(args: argparse.Namespace) -> dict[str, Any]:
    engine = pipeline("mlp", 2, 0, seed=1001)
    engine.load_checkpoint(os.path.join(args.ckpt, "plain"))
    return train(engine, THEN)


def wrong_model(args: argparse.Namespace) -> dict[str, Any]:
    engine = pipeline("tied", 2, 0, seed=1002)
    before = params(engine)
    try:
        engine.load_checkpoint(os.path.join(args.ckpt, "mlp"))
        text = None
    except CheckpointError as exc:
        text = str(exc)
    after = params(engine)
    return {"error_text": text, "unchanged": all(torch.equal(before[k], after[k])
                                                 for k in before)}


def groups_differ(args: argparse.Namespace) -> dict[str, Any]:
    """Stage 1's optimizer has another learning rate: not one set of groups."""
    torch.manual_seed(0)
    module = PipelineModule(layers=mlp_layers(), num_stages=2, loss_fn=F.cross_entropy)
    lr = 0.01 if module.stage_id == 0 else 0.02
    engine, _, _, _ = dsrun.initialize(
        model=module, training_data=class_data(),
        optimizer=lambda ps: torch.optim.AdamW(ps, lr=lr),
        config={"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": 4})
    engine.train_batch()
    try:
        engine.save_checkpoint(os.path.join(args.ckpt, "groups"))
    except CheckpointError as exc:
        return {"error_text": str(exc)}
    return {"error_text": None}


def frozen(args: argparse.Namespace) -> dict[str, Any]:
    """exclude_frozen_parameters: a frozen layer of stage 1 is left out; a
    strict load refuses it (as DeepSpeed), a non-strict one loads the rest
    into a model where it is frozen too."""
    def build(seed: int) -> Any:
        torch.manual_seed(seed)
        module = PipelineModule(layers=mlp_layers(), num_stages=2, loss_fn=F.cross_entropy)
        for name, param in module.named_parameters():
            if name.startswith("5."):
                param.requires_grad_(False)
        engine, _, _, _ = dsrun.initialize(model=module, training_data=class_data(),
                                           config=config(1, 0))
        return engine
    engine = build(0)
    train(engine, 1)
    engine.save_checkpoint(os.path.join(args.ckpt, "frozen"), exclude_frozen_parameters=True)
    saved = params(engine)
    again = build(1)
    try:
        again.load_checkpoint(os.path.join(args.ckpt, "frozen"))
        refused = None
    except CheckpointError as exc:
        refused = str(exc)
    again.load_checkpoint(os.path.join(args.ckpt, "frozen"), load_module_strict=False)
    loaded = params(again)
    return {"refused": refused, "trained_equal": all(torch.equal(saved[k], loaded[k]) for k in saved
                                 if not k.startswith("5.")),
            "frozen_kept": all(not torch.equal(saved[k], loaded[k]) for k in saved
                               if k.startswith("5."))}


def only_rank0(args: argparse.Namespace) -> dict[str, Any]:
    engine = pipeline("mlp", 2, 0, seed=0, checkpoint={"timeout": 3})
    text = None
    if dist.get_rank() == 0:
        try:
            engine.save_checkpoint(os.path.join(args.ckpt, "only0"))
        except CheckpointError as exc:
            text = str(exc)
    dist.barrier()
    return {"error_text": text}


def wide(args: argparse.Namespace) -> dict[str, Any]:
    engine = pipeline("tied", 2, 1, seed=77)
    engine.load_checkpoint(os.path.join(args.ckpt, "tied"))
    dump(args.out, "wide-loaded", engine)

    def save(step: int) -> None:
        if step == FIRST + 2:
            engine.save_checkpoint(os.path.join(args.ckpt, "tied-wide"))
            dump(args.out, "wide-saved", engine)
    record = train(engine, THEN, save)
    dump(args.out, "wide-final", engine)
    return record


def narrow(args: argparse.Namespace) -> dict[str, Any]:
    engine = pipeline("tied", 1, 2, seed=78)
    engine.load_checkpoint(os.path.join(args.ckpt, "tied"))
    record = train(engine, THEN)
    engine.load_checkpoint(os.path.join(args.ckpt, "tied-wide"))
    return {**record, "from_wide": train(engine, 2)}


def narrow_plain(args: argparse.Namespace) -> dict[str, Any]:
    engine, loader = plain(seed=79)
    engine.load_checkpoint(os.path.join(args.ckpt, "mlp"))
    return train_plain(engine, Batches(loader), THEN)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--job", required=True, choices=("straight", "resume", "wide", "narrow"))
    parser.add_argument("--out", required=True)
    parser.add_argument("--ckpt", required=True)
    args = parser.parse_args()
    dsrun.init_distributed()
    with contextlib.suppress(Exception):
        torch.set_num_threads(1)
    out: dict[str, Any] = {"world_size": dist.get_world_size()}
    if args.job == "straight":
        for name in CASES:
            run(out, name, straight_case, args, name)
        run(out, "plain", straight_plain, args)
    elif args.job == "resume":
        for name in CASES:
            run(out, name, resume_case, args, name)
        run(out, "plain->pipeline", plain_into_pipeline, args)
        run(out, "wrong_model", wrong_model, args)
        run(out, "groups_differ", groups_differ, args)
        run(out, "frozen", frozen, args)
        run(out, "only_rank0", only_rank0, args)  # last: the coordinator is unusable after it
    elif args.job == "wide":
        run(out, "wide", wide, args)
    else:
        run(out, "narrow", narrow, args)
        run(out, "pipeline->plain", narrow_plain, args)
    with open(os.path.join(args.out, f"rank{dist.get_rank()}.json"), "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main()
