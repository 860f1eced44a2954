"""A small training job for the checkpoint crash and exit tests.

``--mode crash``: trains 2 steps at ZeRO ``--stage``, saves tag ``good``
(rank 0 also writes the parameters it saved to ``OUT/good.pt``), trains 1
step and saves tag ``bad`` - which a test pause point
(DSRUN_CHECKPOINT_TEST_PAUSE=RANK:PHASE:bad) holds until the test kills a
rank. Every rank writes its pid to ``OUT/pid<R>`` first.
``--mode load``: loads CKPT (``latest``) and writes the parameters to
``OUT/loaded.pt``. ``--mode async-fail``: an asynchronous save that fails in
its background thread, and a script that ends without waiting for it;
``--mode async-fail-raise``: the same, and then the script raises an error
of its own while the save is still in flight.
"""

from __future__ import annotations

import argparse
import errno
import os

import torch
import torch.distributed as dist

import dsrun
from dsrun.runtime.checkpoint import writer


def build(stage: int, **extra: object) -> object:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 64), torch.nn.Tanh(), torch.nn.Linear(64, 4))
    config = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 1000,
              "optimizer": {"type": "AdamW", "params": {"lr": 0.01}},
              "zero_optimization": {"stage": stage}, **extra}
    return dsrun.initialize(model=model, config=config)[0]


def full(engine: object) -> dict[str, torch.Tensor]:
    """The full parameters, on the CPU (whatever device the rank uses)."""
    if engine.zero_stage == 3:  # type: ignore[attr-defined]
        state = engine.optimizer.module_state_dict()  # type: ignore[attr-defined]
    else:
        state = engine.module.state_dict()  # type: ignore[attr-defined]
    return {k: v.detach().cpu().clone() for k, v in state.items()}


def train(engine: object, steps: int) -> None:
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        loss = engine(torch.randn(2, 8, generator=gen)).square().mean()  # type: ignore
        engine.backward(loss)  # type: ignore[attr-defined]
        engine.step()  # type: ignore[attr-defined]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", required=True,
                        choices=("crash", "load", "async-fail", "async-fail-raise"))
    parser.add_argument("--out", required=True)
    parser.add_argument("--ckpt", required=True)
    parser.add_argument("--stage", type=int, default=2)
    args = parser.parse_args()
    if not dist.is_initialized():
        dsrun.init_distributed()
    with open(os.path.join(args.out, f"pid{dist.get_rank()}"), "w") as f:
        f.write(str(os.getpid()))
    if args.mode == "load":
        engine = build(args.stage)
        engine.load_checkpoint(args.ckpt)
        torch.save(full(engine), os.path.join(args.out, "loaded.pt"))
        return
    if args.mode.startswith("async-fail"):
        engine = build(args.stage, checkpoint={"async": True})
        train(engine, 1)
        # the write fails in the background thread (TAG.tmp/ itself is made,
        # and checked, before save_checkpoint returns: a failure there is raised by it)
        def read_only(self: writer.RankWrite) -> None:
            raise OSError(errno.EROFS, "Read-only file system", self.tmp_dir)

        writer.RankWrite._write = read_only  # type: ignore[method-assign]
        engine.save_checkpoint(args.ckpt, tag="doomed")
        if args.mode == "async-fail-raise":
            raise RuntimeError("the script's own error")
        print("script done", flush=True)
        return
    engine = build(args.stage)
    train(engine, 2)
    engine.save_checkpoint(args.ckpt, tag="good")
    state = full(engine)
    if dist.get_rank() == 0:
        torch.save(state, os.path.join(args.out, "good.pt"))
    train(engine, 1)
    engine.save_checkpoint(args.ckpt, tag="bad")


if __name__ == "__main__":
    main()
