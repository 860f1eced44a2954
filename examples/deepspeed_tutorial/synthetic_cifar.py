"""A CIFAR-10-shaped dataset that needs no download (none is possible here).

Images are 3x32x32 floats, labels 0..9. Each class has a smooth random
"template" image (4x4 noise upsampled to 32x32); a sample is its class's
template plus pixel noise, so a small conv net learns it within an epoch or
two - a stand-in for torchvision.datasets.CIFAR10 in the DeepSpeed tutorial.
The data is a pure function of ``seed``: every rank builds the same dataset
and the sampler gives each rank its own part.
"""

import torch
from torch.utils.data import TensorDataset

CLASSES = ("plane", "car", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck")


def synthetic_cifar10(size: int, seed: int = 0, noise: float = 4.0) -> TensorDataset:
    """``size`` (image, label) pairs; the templates depend only on the class."""
    templates = torch.nn.functional.interpolate(
        torch.randn(len(CLASSES), 3, 4, 4, generator=torch.Generator().manual_seed(1234)),
        size=(32, 32), mode="bilinear", align_corners=False)
    gen = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, len(CLASSES), (size,), generator=gen)
    images = templates[labels] + noise * torch.randn(size, 3, 32, 32, generator=gen)
    return TensorDataset(images, labels)
