"""Passes dsrun.initialize a config with a misspelled key (every rank fails)."""

import torch

import dsrun

model = torch.nn.Linear(2, 2)
dsrun.initialize(model=model, config={"train_batch_size": 8,
                                      "zero_optimzation": {"stage": 1}})
