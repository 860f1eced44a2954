"""A small data-parallel training run: `dsrun --num_gpus 2 examples/train.py`.

The process group is already up when this file's first line runs (dsrun's
injected runtime); the script only wraps its model in DDP and trains a tiny
MLP on a synthetic regression task, printing the loss from rank 0.
Also runs as plain `python examples/train.py` (world size 1).

With `--monitor DIR` it trains through dsrun's engine instead of DDP
(`dsrun.initialize`, a warm-up/decay LR schedule) with DeepSpeed's
`csv_monitor` writing to DIR/train (and `tensorboard` to DIR/tensorboard
when the tensorboard package is installed) and `wall_clock_breakdown` on;
then `dsrun plot DIR/train -o run.png` draws the run.
"""

import argparse
import importlib.util

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import dsrun

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=60)
parser.add_argument("--lr", type=float, default=0.05)
parser.add_argument("--batch", type=int, default=32, help="samples per rank per step")
parser.add_argument("--hidden", type=int, default=64, help="hidden layer width")
parser.add_argument("--monitor", metavar="DIR", default=None,
                    help="train with dsrun's engine and write metrics under DIR")
args = parser.parse_args()

dsrun.init_distributed()  # no-op under dsrun; sets up world size 1 under plain python
rank, world = dist.get_rank(), dist.get_world_size()
device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" \
    else torch.device("cpu")

torch.manual_seed(0)  # same initial weights on every rank (DDP also broadcasts them)
true_w = torch.randn(16, 1)
net = torch.nn.Sequential(torch.nn.Linear(16, args.hidden), torch.nn.Tanh(),
                          torch.nn.Linear(args.hidden, 1))


def monitored_engine():
    """dsrun's engine with DeepSpeed's monitor sections (the --monitor run)."""
    config = {
        "train_micro_batch_size_per_gpu": args.batch,
        "steps_per_print": 10,
        "optimizer": {"type": "SGD", "params": {"lr": args.lr}},
        "scheduler": {"type": "WarmupDecayLR", "params": {
            "warmup_max_lr": args.lr, "warmup_num_steps": max(args.steps // 10, 1),
            "total_num_steps": args.steps}},
        "wall_clock_breakdown": True,
        "csv_monitor": {"enabled": True, "output_path": args.monitor, "job_name": "train"},
        "tensorboard": {"enabled": importlib.util.find_spec("tensorboard") is not None,
                        "output_path": args.monitor, "job_name": "tensorboard"},
    }
    engine, *_ = dsrun.initialize(model=net, config=config)
    return engine


if args.monitor:
    engine = monitored_engine()
    model, opt = engine, None
else:
    model = DDP(net.to(device))
    opt = torch.optim.SGD(model.parameters(), lr=args.lr)

gen = torch.Generator().manual_seed(1000 + rank)  # each rank sees its own data shard
for step in range(1, args.steps + 1):
    x = torch.randn(args.batch, 16, generator=gen)
    y = x @ true_w + 0.01 * torch.randn(args.batch, 1, generator=gen)
    loss = torch.nn.functional.mse_loss(model(x.to(device)), y.to(device))
    if opt is None:
        engine.backward(loss)
        engine.step()
    else:
        opt.zero_grad()
        loss.backward()
        opt.step()
    mean = loss.detach().clone()
    dist.all_reduce(mean)
    mean /= world
    if rank == 0 and (step % 10 == 0 or step == 1):
        print(f"step {step:3d}  loss {mean.item():.4f}  (mean over {world} ranks)")
if rank == 0:
    print("training finished")
