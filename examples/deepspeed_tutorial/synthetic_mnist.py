"""An MNIST-shaped dataset that needs no download: flat 784-pixel images, labels 0..9.

Each class has a fixed random template; a sample is its class's template plus
noise. A pure function of ``seed``: every rank builds the same dataset.
"""

import torch
from torch.utils.data import TensorDataset


def synthetic_mnist(size: int, seed: int = 0, noise: float = 8.0) -> TensorDataset:
    templates = torch.randn(10, 784, generator=torch.Generator().manual_seed(4321))
    gen = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, 10, (size,), generator=gen)
    images = templates[labels] + noise * torch.randn(size, 784, generator=gen)
    return TensorDataset(images, labels)
