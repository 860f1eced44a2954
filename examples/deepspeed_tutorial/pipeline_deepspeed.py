"""DeepSpeed's pipeline-parallel tutorial example, run by dsrun.

    dsrun --num_gpus 2 examples/deepspeed_tutorial/pipeline_deepspeed.py \\
        --deepspeed --deepspeed_config examples/deepspeed_tutorial/ds_pipeline_config.json

A two-layer MLP on MNIST-shaped data (synthetic: no download) described as
``LayerSpec`` s and cut into two pipeline stages: each rank builds only its
stage's layer. With 4 ranks the same script runs 2 stages x 2 data-parallel
replicas. The config gives 16-sample micro-batches and 8 of them per step
(``gradient_accumulation_steps``): the pipeline keeps both stages busy 8 of
every 9 slots (1F1B), and ZeRO stage 1 partitions Adam's state within each
stage's data-parallel group.

Training is ``model_engine.train_batch()``, as with DeepSpeed's
PipelineEngine: one call runs forward, backward and the optimizer step of
all 8 micro-batches through both stages and returns the mean loss on every
rank; batches come from the ``training_data`` given to ``initialize`` (only
the first stage reads them; labels travel to the last stage with their
micro-batch id). A per-micro-batch loop (``loss = criterion(model_engine(x),
y); model_engine.backward(loss); model_engine.step()``) cannot drive a
pipeline - only the last stage sees the output - and dsrun says so;
``model_engine(inputs)`` is an inference pass through all stages that returns
the output on the last stage (``None`` elsewhere), used here to measure
accuracy. Plain ``python`` (one process) needs ``--pipeline-parallel-size 1``.
"""

import argparse

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from synthetic_mnist import synthetic_mnist

import dsrun as deepspeed

# isort: split
# after "import dsrun", deepspeed.* names resolve to dsrun's modules (dsrun/_alias.py)
from deepspeed.pipe import LayerSpec, PipelineModule


class SimpleLayer(nn.Module):
    def __init__(self, input_size, output_size):
        super().__init__()
        self.fc = nn.Linear(input_size, output_size)

    def forward(self, x):
        return F.relu(self.fc(x))


def parse_args():
    parser = argparse.ArgumentParser(description="pipeline-parallel MLP")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--pipeline-parallel-size", type=int, default=2)
    parser.add_argument("--train-size", type=int, default=4096)
    parser.add_argument("--test-size", type=int, default=512)
    parser.add_argument("--local_rank", type=int, default=-1)
    parser = deepspeed.add_config_arguments(parser)
    return parser.parse_args()


def main():
    args = parse_args()
    deepspeed.init_distributed()
    layers = [LayerSpec(SimpleLayer, 784, 128), LayerSpec(SimpleLayer, 128, 10)]
    pipeline_model = PipelineModule(layers=layers, num_stages=args.pipeline_parallel_size,
                                    loss_fn=nn.CrossEntropyLoss(), seed_layers=True)
    model_engine, optimizer, _, _ = deepspeed.initialize(
        args=args, model=pipeline_model, training_data=synthetic_mnist(args.train_size))
    rank0 = dist.get_rank() == 0
    if rank0:
        print(f"{model_engine.num_stages} stage(s) x "
              f"{model_engine.grid.get_data_parallel_world_size()} replica(s); global batch "
              f"{model_engine.train_batch_size()} = micro-batch "
              f"{model_engine.train_micro_batch_size_per_gpu()} x "
              f"{model_engine.gradient_accumulation_steps()} micro-batches x replicas",
              flush=True)

    for step in range(1, args.steps + 1):
        loss = model_engine.train_batch()
        if rank0 and (step == 1 or step % 10 == 0):
            print(f"step {step}: loss {loss.item():.4f}", flush=True)

    # accuracy on held-out data, one inference pass per batch of 64
    testset = synthetic_mnist(args.test_size, seed=1)
    correct = torch.zeros(2)
    for start in range(0, len(testset), 64):
        images, labels = testset[start:start + 64]
        outputs = model_engine(images.to(model_engine.device))
        if outputs is not None:  # the last stage
            correct += torch.tensor([(outputs.argmax(dim=1).cpu() == labels).sum().item(),
                                     len(labels)])
    if model_engine.is_last_stage() and model_engine.grid.get_data_parallel_id() == 0:
        print(f"held-out accuracy {correct[0] / correct[1]:.3f} (stage "
              f"{model_engine.stage_id})", flush=True)


if __name__ == "__main__":
    main()
