"""The GPU tier: skipped, with the reason, where CUDA is not available."""

from __future__ import annotations

import pytest


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False "
                                   "here); the GPU tier runs on GPU hosts")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
