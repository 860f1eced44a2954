"""The multi-GPU training-loop variant of DeepSpeed's getting-started example.

    dsrun --num_gpus 2 examples/deepspeed_tutorial/train_loop.py \\
        --deepspeed --deepspeed_config examples/deepspeed_tutorial/ds_config.json

Here the script owns its data pipeline, as most multi-GPU training loops do:
it builds a ``DistributedSampler`` + ``DataLoader`` itself, with the engine's
micro-batch size, reshuffles every epoch, lets the engine handle gradient
accumulation (``step()`` only updates at the boundary), averages the epoch
loss over ranks with ``torch.distributed`` and evaluates accuracy on a held-out
set at the end. Rank 0 prints. Also runs as plain ``python`` (world size 1).
"""

import argparse

import torch
import torch.distributed as dist
import torch.nn as nn
from synthetic_cifar import synthetic_cifar10
from torch.utils.data import DataLoader, DistributedSampler

import dsrun as deepspeed


def parse_args():
    parser = argparse.ArgumentParser(description="multi-GPU training loop")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--train-size", type=int, default=2048)
    parser.add_argument("--test-size", type=int, default=512)
    parser.add_argument("--local_rank", type=int, default=-1)
    parser = deepspeed.add_config_arguments(parser)
    return parser.parse_args()


def make_model():
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(32 * 8 * 8, 64), nn.ReLU(), nn.Linear(64, 10))


def evaluate(engine, dataset):
    """Accuracy over the whole held-out set, each rank scoring its shard."""
    sampler = DistributedSampler(dataset, shuffle=False)
    loader = DataLoader(dataset, batch_size=64, sampler=sampler)
    engine.eval()
    counts = torch.zeros(2)
    with torch.no_grad():
        for inputs, labels in loader:
            predicted = engine(inputs.to(engine.device)).argmax(dim=1).cpu()
            counts += torch.tensor([(predicted == labels).sum().item(), len(labels)])
    engine.train()
    dist.all_reduce(counts)
    return (counts[0] / counts[1]).item()


def main():
    args = parse_args()
    deepspeed.init_distributed()
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = make_model()
    engine, optimizer, _, lr_scheduler = deepspeed.initialize(
        args=args, model=model, model_parameters=model.parameters())

    trainset = synthetic_cifar10(args.train_size, seed=0)
    testset = synthetic_cifar10(args.test_size, seed=1)
    sampler = DistributedSampler(trainset)  # rank and world size from torch.distributed
    loader = DataLoader(trainset, batch_size=engine.train_micro_batch_size_per_gpu(),
                        sampler=sampler)
    criterion = nn.CrossEntropyLoss()
    if rank == 0:
        micro = engine.train_micro_batch_size_per_gpu()
        print(f"{dist.get_world_size()} rank(s), micro-batch {micro}, accumulation "
              f"{engine.gradient_accumulation_steps()}, global batch {engine.train_batch_size()}",
              flush=True)

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        total = torch.zeros(2)
        for inputs, labels in loader:
            inputs, labels = inputs.to(engine.device), labels.to(engine.device)
            loss = criterion(engine(inputs), labels)
            engine.backward(loss)
            engine.step()
            total += torch.tensor([loss.item(), 1.0])
        dist.all_reduce(total)  # mean over every micro-batch of every rank
        if rank == 0:
            print(f"epoch {epoch + 1}: loss {total[0] / total[1]:.4f}, optimizer steps "
                  f"{engine.global_steps}, lr {engine.get_lr()[0]:.2e}", flush=True)

    accuracy = evaluate(engine, testset)
    if rank == 0:
        print(f"held-out accuracy {accuracy:.3f}", flush=True)


if __name__ == "__main__":
    main()
