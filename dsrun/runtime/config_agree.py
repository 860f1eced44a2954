"""Whether every rank resolved the same training config.

``dsrun --config`` reaches other hosts as a path, so a stale copy on one
host, or a script that builds its config from per-rank values, gives ranks
different settings: a different learning rate or clipping silently splits
the replicas, a different stage or accumulation count dies later in a
collective with an error that does not say why. ``initialize()`` compares
a digest of the resolved config across ranks (one all-reduce of two
integers); only when they differ are the values gathered, and rank 0 names
the keys that differ (DeepSpeed does not check this).
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
from typing import Any

import torch
import torch.distributed as dist

log = logging.getLogger("dsrun.runtime.engine")


def _flat(value: Any, prefix: str = "") -> dict[str, str]:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        out: dict[str, str] = {}
        for field in dataclasses.fields(value):
            if field.name != "source":  # where the file lies may differ by host
                out.update(_flat(getattr(value, field.name), f"{prefix}{field.name}."))
        return out
    return {prefix.rstrip("."): repr(value)}


def differing_keys(flats: list[dict[str, str]]) -> list[str]:
    """The keys whose values are not the same in every rank's ``flats``."""
    keys = set().union(*flats)
    return sorted(k for k in keys if len({flat.get(k) for flat in flats}) > 1)


def check_ranks_agree(config: Any) -> list[str]:
    """Warn on rank 0 naming the config keys whose resolved values differ
    between ranks; returns them (empty when all agree or world size 1)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return []
    flat = _flat(config)
    text = "\n".join(f"{k}={v}" for k, v in sorted(flat.items()))
    digest = int.from_bytes(hashlib.sha256(text.encode()).digest()[:7], "little")
    from dsrun.runtime.dist import group_uses_nccl  # (it imports the engine's layers)

    device = torch.device("cuda", torch.cuda.current_device()) if group_uses_nccl() \
        else torch.device("cpu")
    both = torch.tensor([digest, -digest], dtype=torch.int64, device=device)
    dist.all_reduce(both, op=dist.ReduceOp.MAX)  # max and -min: equal when all agree
    if int(both[0]) == -int(both[1]):
        return []
    flats: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(flats, flat)
    keys = differing_keys(flats)
    if dist.get_rank() == 0:
        shown = ", ".join(keys[:6]) + (f" and {len(keys) - 6} more" if len(keys) > 6 else "")
        example = keys[0]
        values = "; ".join(f"rank {r}: {f.get(example)}" for r, f in enumerate(flats[:4]))
        log.warning("the ranks resolved different training configs: %s differ (%s: %s); a "
                    "config file that differs between hosts, or one built from per-rank "
                    "values? Every rank must train with the same settings", shown, example,
                    values)
    return keys
