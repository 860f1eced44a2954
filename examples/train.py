"""A small data-parallel training run: `dsrun --num_gpus 2 examples/train.py`.

The process group is already up when this file's first line runs (dsrun's
injected runtime); the script only wraps its model in DDP and trains a tiny
MLP on a synthetic regression task, printing the loss from rank 0.
Also runs as plain `python examples/train.py` (world size 1).
"""

import argparse

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import dsrun

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=60)
parser.add_argument("--lr", type=float, default=0.05)
parser.add_argument("--batch", type=int, default=32, help="samples per rank per step")
args = parser.parse_args()

dsrun.init_distributed()  # no-op under dsrun; sets up world size 1 under plain python
rank, world = dist.get_rank(), dist.get_world_size()
device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" \
    else torch.device("cpu")

torch.manual_seed(0)  # same initial weights on every rank (DDP also broadcasts them)
true_w = torch.randn(16, 1)
model = DDP(torch.nn.Sequential(
    torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1)).to(device))
opt = torch.optim.SGD(model.parameters(), lr=args.lr)

gen = torch.Generator().manual_seed(1000 + rank)  # each rank sees its own data shard
for step in range(1, args.steps + 1):
    x = torch.randn(args.batch, 16, generator=gen)
    y = x @ true_w + 0.01 * torch.randn(args.batch, 1, generator=gen)
    loss = torch.nn.functional.mse_loss(model(x.to(device)), y.to(device))
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
