"""``deepspeed.checkpoint.utils``: what Accelerate and Hugging Face's
Trainer call when they save a model (``accelerator.get_state_dict``)."""

from __future__ import annotations

from typing import Any, Union

import torch

__all__ = ["clone_tensors_for_torch_save"]


def clone_tensors_for_torch_save(item: Any, device: Union[str, torch.device] = "cpu") -> Any:
    """``item`` with every tensor in it (nested in lists, tuples and dicts)
    replaced by a detached copy of its own on ``device``, so that
    ``torch.save`` writes each tensor's values and not the whole storage it
    may be a view of (DeepSpeed's; its flat buffers are such storages)."""
    target = torch.device(device)
    if isinstance(item, torch.Tensor):
        value = item.detach()
        return value.clone() if value.device == target else value.to(target)
    if isinstance(item, dict):
        return type(item)({k: clone_tensors_for_torch_save(v, target) for k, v in item.items()})
    if isinstance(item, list):
        return [clone_tensors_for_torch_save(v, target) for v in item]
    if isinstance(item, tuple):
        values = [clone_tensors_for_torch_save(v, target) for v in item]
        return type(item)(*values) if hasattr(item, "_fields") else tuple(values)
    return item
