"""Passes dsrun.initialize a config with a misspelled key (every rank fails).

The ranks meet at a barrier first, so that both reach the error: without
it a rank still importing torch when the other has failed is stopped by
the fail-fast teardown before it gets there."""

import torch
import torch.distributed as dist

import dsrun

model = torch.nn.Linear(2, 2)
dist.barrier()
dsrun.initialize(model=model, config={"train_batch_size": 8,
                                      "zero_optimzation": {"stage": 1}})
