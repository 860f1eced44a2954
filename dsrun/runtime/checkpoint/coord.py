"""How the ranks of a save or load agree, with a deadline and named ranks.

:meth:`Coordinator.agree` is the first step of every save and load: each
rank posts what it was asked (the tag, ...) under a per-call key in the
process group's store and waits, at most ``timeout_s``, for every other
rank's. A rank that never arrives - ``save_checkpoint`` called on rank 0
only - is named in the error instead of hanging the job; ranks that were
asked different things (different tags) get one error naming which rank
asked what. Keys are numbered by call, so every rank must make its
checkpoint calls in the same order (as DeepSpeed requires); after a
timeout the numbering cannot be trusted and every later call fails at once.

:meth:`Coordinator.exchange` (an all-gather of small Python objects) is
how ranks learn each other's results after the agreement: it runs on a
gloo group of its own (created on first use, after an agreement, so all
ranks are there), never on the training group, whatever the training
backend.
"""

from __future__ import annotations

import datetime
import itertools
import json
import logging
from collections.abc import Sequence
from typing import Any, Optional

import torch.distributed as dist

from dsrun import comm as collectives
from dsrun.errors import CheckpointError

log = logging.getLogger("dsrun.runtime.checkpoint")

EXCHANGE_TIMEOUT_S = 3600.0  # once all ranks are in, writing may take long
_calls = itertools.count()  # process-wide: all engines of a process share the numbering


def describe_ranks(ranks: Sequence[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


class Coordinator:
    """Agreement and exchange among all ranks of the default group."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = float(timeout_s)
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        self._group: Any = None
        self._broken: Optional[str] = None

    def _store(self) -> Any:
        try:
            return dist.distributed_c10d._get_default_store()
        except (AttributeError, RuntimeError, ValueError):
            return None

    def agree(self, what: str, payload: dict[str, Any]) -> list[dict[str, Any]]:
        """Every rank's ``payload`` for this call, in rank order (module docstring)."""
        if self._broken:
            raise CheckpointError(f"{what} refused: {self._broken}")
        call = next(_calls)
        if self.world == 1:
            return [payload]
        store = self._store()
        if store is None:  # no store to name the missing ranks with
            return self.exchange(payload)
        prefix = f"dsrun/checkpoint/{call}/"
        store.set(prefix + str(self.rank), json.dumps(payload))
        keys = [prefix + str(r) for r in range(self.world)]
        try:
            store.wait(keys, datetime.timedelta(seconds=self.timeout_s))
        except Exception:  # noqa: BLE001 - the store says "timeout" in its own way
            missing = [r for r in range(self.world) if not store.check([keys[r]])]
            present = [r for r in range(self.world) if r not in missing]
            self._broken = (f"an earlier {what} timed out waiting for "
                            f"{describe_ranks(missing)}; restart the job")
            raise CheckpointError(
                f"{what} was called on {describe_ranks(present)} but {describe_ranks(missing)} "
                f"did not call it within {self.timeout_s:g} s (checkpoint.timeout): every rank "
                "must call it, with the same arguments") from None
        out = [json.loads(store.get(k)) for k in keys]
        if call >= 2:  # every rank has read call-2's keys once it posted call-1's
            try:
                store.delete_key(f"dsrun/checkpoint/{call - 2}/{self.rank}")
            except Exception:  # noqa: BLE001 - a store without deletion only keeps them
                pass
        return out

    def exchange(self, obj: Any) -> list[Any]:
        """``obj`` of every rank, in rank order (an all-gather on the
        checkpoint group; world size 1: no communication)."""
        if self.world == 1:
            return [obj]
        if self._group is None:
            self._group = dist.new_group(
                backend="gloo",
                timeout=datetime.timedelta(seconds=max(self.timeout_s, EXCHANGE_TIMEOUT_S)))
        out: list[Any] = [None] * self.world
        try:
            collectives.all_gather_object(out, obj, group=self._group)
        except RuntimeError as exc:
            self._broken = f"a checkpoint exchange between ranks failed ({exc})"
            raise CheckpointError(f"ranks could not exchange checkpoint status: {exc} (a rank "
                                  "died or stopped during the save or load)") from None
        return out


def check_same(values: Sequence[Any], what: str) -> None:
    """One error naming which ranks gave which value when they differ."""
    if all(v == values[0] for v in values):
        return
    by_value: dict[str, list[int]] = {}
    for rank, value in enumerate(values):
        by_value.setdefault(repr(value), []).append(rank)
    parts = "; ".join(f"{describe_ranks(ranks)}: {value}" for value, ranks in by_value.items())
    raise CheckpointError(f"the ranks disagree on {what} ({parts}): every rank must pass the "
                          "same value")


def raise_failures(statuses: Sequence[Optional[str]], what: str) -> None:
    """Raise (on every rank) when any rank reported an error; ranks that
    report the same error are named together."""
    by_text: dict[str, list[int]] = {}
    for rank, text in enumerate(statuses):
        if text:
            by_text.setdefault(text, []).append(rank)
    if not by_text:
        return
    if len(by_text) == 1:
        text, ranks = next(iter(by_text.items()))
        raise CheckpointError(f"{what} failed on {describe_ranks(ranks)}: {text}")
    lines = "\n".join(f"  {describe_ranks(ranks)}: {text}" for text, ranks in by_text.items())
    raise CheckpointError(f"{what} failed:\n{lines}")
