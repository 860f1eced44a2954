"""DeepSpeed's getting-started data-parallel example (CIFAR-10), run by dsrun.

    dsrun --num_gpus 2 examples/deepspeed_tutorial/cifar10_deepspeed.py \\
        --deepspeed --deepspeed_config examples/deepspeed_tutorial/ds_config.json

This is DeepSpeed's tutorial script with one change of import
(``import dsrun as deepspeed``) and a synthetic CIFAR-shaped dataset instead
of the torchvision download. The config gives the batch sizes (32 = 8 per
rank x 2 accumulation steps x 2 ranks), Adam and a WarmupLR schedule;
``deepspeed.initialize`` returns the engine and a dataloader that shards the
training set across ranks. Also runs as plain ``python`` (world size 1).
"""

import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F
from synthetic_cifar import synthetic_cifar10

import dsrun as deepspeed


def add_argument():
    parser = argparse.ArgumentParser(description="CIFAR")
    parser.add_argument("-e", "--epochs", default=2, type=int, help="number of total epochs")
    parser.add_argument("--log-interval", type=int, default=32,
                        help="output logging information at a given interval")
    parser.add_argument("--train-size", type=int, default=2048)
    parser.add_argument("--local_rank", type=int, default=-1,
                        help="local rank passed from distributed launcher")
    parser = deepspeed.add_config_arguments(parser)
    return parser.parse_args()


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 6, 5)
        self.pool = nn.MaxPool2d(2, 2)
        self.conv2 = nn.Conv2d(6, 16, 5)
        self.fc1 = nn.Linear(16 * 5 * 5, 120)
        self.fc2 = nn.Linear(120, 84)
        self.fc3 = nn.Linear(84, 10)

    def forward(self, x):
        x = self.pool(F.relu(self.conv1(x)))
        x = self.pool(F.relu(self.conv2(x)))
        x = x.view(-1, 16 * 5 * 5)
        x = F.relu(self.fc1(x))
        x = F.relu(self.fc2(x))
        return self.fc3(x)


def main():
    args = add_argument()
    deepspeed.init_distributed()
    torch.manual_seed(0)

    trainset = synthetic_cifar10(args.train_size, seed=0)
    net = Net()
    parameters = filter(lambda p: p.requires_grad, net.parameters())

    # Initialize DeepSpeed to use the following features
    # 1) Distributed model
    # 2) Distributed data loader
    # 3) DeepSpeed optimizer
    model_engine, optimizer, trainloader, __ = deepspeed.initialize(
        args=args, model=net, model_parameters=parameters, training_data=trainset)

    fp16 = model_engine.fp16_enabled()
    criterion = nn.CrossEntropyLoss()
    # DeepSpeed's script moves batches to model_engine.local_rank (a CUDA index);
    # model_engine.device is the same on GPUs and also right on CPU ranks.
    device = model_engine.device
    rank0 = model_engine.global_rank == 0
    for epoch in range(args.epochs):
        running_loss = 0.0
        for i, data in enumerate(trainloader):
            inputs, labels = data[0].to(device), data[1].to(device)
            if fp16:
                inputs = inputs.half()
            outputs = model_engine(inputs)
            loss = criterion(outputs, labels)
            model_engine.backward(loss)
            model_engine.step()

            running_loss += loss.item()
            if i % args.log_interval == (args.log_interval - 1):
                if rank0:
                    print(f"[{epoch + 1}, {i + 1:5d}] loss: {running_loss / args.log_interval:.3f}",
                          flush=True)
                running_loss = 0.0
    if rank0:
        print("Finished Training", flush=True)


if __name__ == "__main__":
    main()
