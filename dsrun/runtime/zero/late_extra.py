"""Telling every rank that one got a *late* extra gradient at ZeRO stage 1
(:mod:`~.reducer`): a parameter's second gradient in one backward, first
seen after a round in which no rank had any, where the ranks stopped
agreeing on extra gradients (on an accelerator, the agreement's read is a
host sync). Such a gradient is refused; refused on the rank that saw it
alone, the others would wait in that round's collectives (NCCL: a hang).

So that rank only notes it and goes on with the round like the others; at
the round's end every rank all-reduces (MAX, asynchronously) the noted
parameter, and reads it when its next round starts - then long completed,
through a host copy made on the stream (no sync with later work) - where
all of them raise the same error. An unwatched round costs one 8-byte
all-reduce and no host sync.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from dsrun import comm as collectives


class LateNotice:
    """The MAX over the ranks of one number per round, read a round later."""

    def __init__(self, group: Any, device: torch.device) -> None:
        self.group = group
        # kept: a fresh device tensor from a Python number would be a
        # pageable host-to-device copy, which waits for the stream
        self._value = torch.full((1,), -1, dtype=torch.int64, device=device)
        self._host = torch.empty(1, dtype=torch.int64, pin_memory=self._value.is_cuda)
        self._work: Any = None
        self._event: Any = None
        self._pending = False

    def announce(self, key: int) -> None:
        """End of a round: this rank's ``key`` (-1: nothing late here)."""
        self._value.fill_(key)
        self._work = collectives.all_reduce(self._value, op=dist.ReduceOp.MAX,
                                            group=self.group, async_op=True)
        self._pending = True
        if self._value.is_cuda:  # read later without syncing with what follows
            if self._work is not None:
                self._work.wait()  # the stream waits, not the host
            self._host.copy_(self._value, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()

    def take(self) -> int:
        """The largest key any rank announced last (-1: none, or nothing
        announced since the last take)."""
        if not self._pending:
            return -1
        self._pending = False
        if self._event is not None:
            self._event.synchronize()
            self._event = None
        else:
            if self._work is not None:
                self._work.wait()
            self._host.copy_(self._value)
        self._work = None
        return int(self._host.item())
