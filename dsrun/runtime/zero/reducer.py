"""ZeRO stage 2 gradient reduction: buckets reduced during backward straight
into each owner's partition accumulator.

Plan (fixed at construction, identical on every rank): trainable parameters
in expected backward order are packed by :func:`~.partition.plan_buckets`
into buckets of at most ``bucket_numel`` elements (a bigger parameter is
alone). A bucket's buffer holds its parameters' gradients back to back; the
:class:`~.partition.GroupLayout` tells which ``(owner, start, length)``
ranges of it belong to which rank's partition.

One round per backward:

1. A post-accumulate-grad hook copies the parameter's gradient times ``1/N``
   into its slot of the bucket buffer (DDP's fused pre-division) and sets
   ``param.grad = None``: the full gradient is released at once.
2. When a bucket is complete *and every bucket before it was launched*, it
   is launched (``async_op``): :func:`~.comm.start_reduce_to_owners`. The
   strict order keeps the collectives identical on all ranks whatever order
   the hooks fire in.
3. Buffers: ``n_buffers`` (2 with ``overlap_comm``, else 1) slots of the
   largest bucket's size are used in turn (a parameter bigger than the cap
   is reduced in its own gradient tensor instead, as DeepSpeed does);
   before bucket ``k`` takes its slot, bucket ``k - n_buffers`` is waited
   for and **drained**: this rank's ranges are handed to ``land(group,
   shard start, values)``, which copies (first round after a step) or adds
   them into the fp32 partition accumulators - in host memory under
   offload, through :class:`~.offload.Landing`'s side-stream copies, so the
   slot waits (on the device) for those copies before it is written again
   (``before_reuse``). So with overlap one bucket is reduced while the next
   one fills; without, each reduction completes before backward goes on. A
   gradient that arrives for a bucket that has no buffer yet stays in
   ``param.grad`` until the bucket gets one.
4. At the end of backward (an autograd engine callback, queued by the first
   hook of the round on the pass it runs in - re-queued on the enclosing
   pass when that pass was a reentrant checkpoint's nested one, which does
   not end the round: :meth:`_pass_ended`; :meth:`finish`, which the engine
   calls after every backward, does the same and is idempotent) the
   remaining buckets are launched - parameters that got no gradient
   contribute zeros - and every reduction is waited for and drained; then
   ``on_round_end()``.

**A parameter that gets several gradients in one backward** (used in
several reentrant activation checkpoints, or inside one and outside it):
stage 2 refuses it, as DeepSpeed's does. With ``extras`` (stage 1, which
DeepSpeed trains such a model at) its gradients are summed: one that
arrives before its bucket is launched is added into its slot (or into
``param.grad`` while the bucket has no buffer); one that arrives after is
an **extra** gradient, kept aside. At the end of the round the ranks
all-reduce (MAX) each parameter's "had extra gradients" flag and gradient
count, then all-reduce the kept extras of every parameter some rank
flagged (zeros where a rank has none, pre-divided by N) and add this
rank's ranges into the accumulators; each parameter then waits for the
largest count seen before its bucket counts as complete, so later rounds
send nothing extra. This agreement runs in the first round and, once any
rank had extra gradients, in every round after (a data-dependent number of
uses); on CPU (gloo), where reading it is no host sync, in every round.
Otherwise (on an accelerator, after a first round in which no rank had
extra gradients) an extra gradient first seen in a later round is refused,
on every rank at the start of the next round (:mod:`~.late_extra`).
Costs, once some rank had extra gradients: a bucket holding a reused
parameter waits for its last gradient, and the buckets after it (launched
in order) wait too - a shared block early in the order delays their
reductions to near the end of backward (no overlap with backward); and on
an accelerator the agreement's read is a host sync at every round's end.

A bucket's buffer holds its parameters in flat-buffer order (backward order
is roughly the reverse), so this rank's share of a bucket is usually one
contiguous range of its partition: one ``land`` per bucket. Every round
writes every element of this rank's partition ranges (missing gradients as
zeros), which is what lets the first round of a step *copy* into the
accumulators instead of zeroing them first and adding. ``contiguous_gradients``:
True keeps the slot buffers allocated for the whole run (no allocation
during backward); False allocates a bucket's buffer when it opens and frees
it when drained. At world size 1 (offload) nothing is reduced: the buckets
only batch the copies to the host.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from dsrun import comm as collectives
from dsrun.errors import DsrunError
from dsrun.runtime.zero.comm import CommStrategy, Pending, start_reduce_to_owners
from dsrun.runtime.zero.late_extra import LateNotice
from dsrun.runtime.zero.partition import GroupLayout, plan_buckets
from dsrun.runtime.zero.weakhooks import remove_when_collected

Land = Callable[[int, int, torch.Tensor], None]  # (group, shard start, values)


@dataclass(frozen=True)
class GradSource:
    """One trainable parameter: its group and index in that group."""

    param: torch.Tensor = field(compare=False)
    group: int
    index: int


@dataclass
class _Bucket:
    keys: tuple[int, ...]  # indices into GradReducer.sources
    offsets: tuple[int, ...]  # slot start of each key in the buffer
    numel: int
    ranges: tuple[tuple[int, int, int], ...]  # (owner, buffer start, length)
    mine: tuple[tuple[int, int, int, int], ...]  # (group, shard start, buffer start, length)
    solo: bool = False  # one parameter bigger than the cap: reduced in its own gradient
    # per-round state
    opened: bool = False
    ready: set[int] = field(default_factory=set)
    buffer: Optional[torch.Tensor] = None
    inflight: Optional[Pending] = None


class GradReducer:
    """Stage-2 bucketed reduce-to-owner of gradients (module docstring)."""

    def __init__(self, sources: Sequence[GradSource], layouts: Sequence[GroupLayout], *,
                 rank: int, world_size: int, group: Any, bucket_numel: int, overlap: bool,
                 contiguous: bool, dtype: torch.dtype, land: Land,
                 strategy: Optional[CommStrategy] = None,
                 before_reuse: Callable[[], None] = lambda: None,
                 on_round_end: Callable[[], None] = lambda: None,
                 add_extra: Optional[Land] = None) -> None:
        self.sources = list(sources)
        self.layouts = list(layouts)
        self.group = group
        self.rank = rank
        self.scale = 1.0 / world_size
        self.strategy = strategy
        self.dtype = dtype
        self.land = land
        self.before_reuse = before_reuse
        self.on_round_end = on_round_end
        self.contiguous = contiguous
        self.n_buffers = 2 if overlap else 1
        plan = plan_buckets([s.param.numel() for s in self.sources], bucket_numel)
        self.buckets = [self._make_bucket(keys, layouts) for keys in plan]
        for bucket in self.buckets:
            bucket.solo = bucket.numel > bucket_numel
        self.slot = {key: (b, offset) for b, bucket in enumerate(self.buckets)
                     for key, offset in zip(bucket.keys, bucket.offsets)}
        self.buffer_numel = max((b.numel for b in self.buckets if not b.solo), default=0)
        self._slots: list[Optional[torch.Tensor]] = [None] * self.n_buffers
        self._active = False
        self._queued = False  # an end-of-pass callback is queued for this round
        self._next = 0
        # several gradients of one parameter per backward (module docstring):
        # ``add_extra`` lands reduced extra gradients (adding); None refuses them
        self.add_extra = add_extra
        self._count = [0] * len(self.sources)  # gradients each got this round
        self._expect = [1] * len(self.sources)  # the largest count seen
        self._extra: dict[int, torch.Tensor] = {}  # gradients after the bucket was sent
        self._watch = add_extra is not None  # agree on extras at this round's end
        self._had_extra = False  # some rank had extra gradients once: watch every round
        self._late = -1  # the first parameter with a late extra gradient this round
        self._notice: Optional[LateNotice] = None
        # on CPU reading the agreement is no host sync: watch every round, so
        # that a reuse first seen in a later round is summed, not refused on
        # the rank that sees it alone (stage 0's GradSync does the same)
        self._keep_watching = self._watch and bool(self.sources) \
            and self.sources[0].param.device.type == "cpu"
        self._handles = [s.param.register_post_accumulate_grad_hook(self._hook(key))
                         for key, s in enumerate(self.sources)]
        remove_when_collected(self, self._handles)

    def _make_bucket(self, keys: Sequence[int], layouts: Sequence[GroupLayout]) -> _Bucket:
        """Slots in flat-buffer order (module docstring), ranges merged."""
        def flat_position(key: int) -> tuple[int, int]:
            source = self.sources[key]
            return source.group, layouts[source.group].offsets[source.index] or 0

        slot: dict[int, int] = {}
        ranges: list[tuple[int, int, int]] = []
        mine: list[tuple[int, int, int, int]] = []
        total = 0
        for key in sorted(keys, key=flat_position):
            source = self.sources[key]
            layout = layouts[source.group]
            slot[key] = total
            for owner, param_offset, length in layout.param_owners(source.index):
                ranges.append((owner, total + param_offset, length))
                if owner == self.rank:
                    flat = layout.offsets[source.index] + param_offset  # type: ignore[operator]
                    shard_start = flat - self.rank * layout.partition_numel
                    _append_merged(mine, (source.group, shard_start, total + param_offset,
                                          length))
            total += source.param.numel()
        return _Bucket(tuple(keys), tuple(slot[k] for k in keys), total, tuple(ranges),
                       tuple(mine))

    def slot_buffers(self) -> list[torch.Tensor]:
        """The slot buffers currently allocated (for memory accounting)."""
        return [b for b in self._slots if b is not None]

    # ----------------------------------------------------------- a round

    def _hook(self, key: int) -> Callable[[torch.Tensor], None]:
        reducer = weakref.ref(self)  # the parameter must not keep it alive (weakhooks.py)

        def on_grad(param: torch.Tensor) -> None:
            alive = reducer()
            if alive is not None:
                alive._on_grad(key, param)
        return on_grad

    def _on_grad(self, key: int, param: torch.Tensor) -> None:
        if not self._active:
            self._begin_round()
        elif not self._queued:
            self._queue_end()
        b, _ = self.slot[key]
        bucket = self.buckets[b]
        self._count[key] += 1
        if key in bucket.ready:
            if self.add_extra is None:
                raise DsrunError(self._twice(key))
            if b < self._next:  # its bucket was sent: reduced again at the round's end
                self._keep_extra(key, param)
                return
            if bucket.opened:  # else autograd added it into param.grad, not copied yet
                self._copy_in(key, add=True)
        else:
            bucket.ready.add(key)
            if bucket.opened:
                self._copy_in(key)
        self._launch_complete()

    def _keep_extra(self, key: int, param: torch.Tensor) -> None:
        """Keep a gradient that came after its bucket was launched (a late
        one, while unwatched: noted, refused later: :mod:`~.late_extra`)."""
        grad = param.grad
        assert grad is not None, "hooked parameter without a gradient"
        param.grad = None
        if not self._watch:  # refused on every rank at the next round's start
            self._late = key if self._late < 0 else self._late
            return
        kept = self._extra.get(key)
        if kept is None:
            self._extra[key] = grad.detach().reshape(-1).to(self.dtype, copy=True)
        else:
            kept.add_(grad.reshape(-1))

    def _twice(self, key: int) -> str:
        """The error for a second gradient of one parameter in one round.
        Each backward pass has its own round, so the second one came from a
        nested pass inside it: a reentrant checkpoint's recomputation."""
        source = self.sources[key]
        return (f"parameter {source.index} of param group {source.group} (shape "
                f"{tuple(source.param.shape)}) received gradients twice in one backward pass; "
                "ZeRO stage 2 reduces each gradient once per backward, as it arrives. The "
                "likely cause: a parameter used in several reentrant activation checkpoints, "
                "or inside one and outside it (a "
                "shared layer, a tied embedding/head) - torch.utils.checkpoint's "
                "use_reentrant=True, Hugging Face gradient_checkpointing's default - gets a "
                "gradient in each checkpoint's nested backward. Use use_reentrant=False "
                "(Hugging Face: gradient_checkpointing_enable(gradient_checkpointing_kwargs="
                "{'use_reentrant': False})), or ZeRO stage 0, 1 or 3, which add them up "
                "(DeepSpeed's stage 2 refuses it too)")

    def _refuse_late(self) -> None:
        """Every rank: some rank got a late extra gradient last round."""
        key = self._notice.take() if self._notice is not None else -1
        if key < 0:
            return
        source = self.sources[key]
        raise DsrunError(
            f"parameter {source.index} of param group {source.group} (shape "
            f"{tuple(source.param.shape)}) received gradients twice in one backward pass (on "
            "some rank, in the last backward) for the first time after a first backward in "
            "which no rank had any: the ranks no longer agree on extra gradients (ZeRO stage "
            "1 without gradient accumulation, on an accelerator, where that agreement is a "
            "host sync), so that backward's gradients, and the step after it, lacked it; "
            "use reentrant activation "
            "checkpoints with use_reentrant=False, or gradient_accumulation_steps > 1")

    def _begin_round(self) -> None:
        self._refuse_late()
        self._active = True
        self._next = 0
        for bucket in self.buckets:
            bucket.ready = set()
        self._count = [0] * len(self.sources)
        self._extra = {}
        self._open(0)
        self._queue_end()

    def _queue_end(self) -> None:
        """End the round when the backward pass now running ends."""
        torch.autograd.Variable._execution_engine.queue_callback(self._pass_ended)
        self._queued = True

    def _pass_ended(self) -> None:
        """A pass that delivered gradients ended. A nested one (a reentrant
        checkpoint's, run by a node of the enclosing pass, still running)
        does not end the round - else a rank's number of rounds, so of
        collectives, would be its number of checkpoints: a one-time hook on
        that node queues the end on the enclosing pass when the node returns
        (so a backward whose gradients all came in nested passes, with no
        engine :meth:`finish` after it, still ends its round)."""
        self._queued = False
        node = torch._C._current_autograd_node()  # torch >= 2.1
        if node is None:
            return self.finish()

        def node_done(*_: Any) -> None:
            handle.remove()
            if self._active and not self._queued:  # in the enclosing pass
                self._queue_end()
        # runs though added while the node runs: torch with pytorch#134728 (2024-09)
        handle = node.register_hook(node_done)

    def _launch_complete(self) -> None:
        while self._next < len(self.buckets):
            bucket = self.buckets[self._next]
            if not bucket.opened or len(bucket.ready) < len(bucket.keys):
                return
            if self._had_extra and any(self._count[k] < self._expect[k] for k in bucket.keys):
                return  # a parameter known to get more gradients: wait for them
            self._launch(self._next)

    def _copy_in(self, key: int, add: bool = False) -> None:
        """The parameter's gradient (times 1/N) into its slot; ``add``: onto
        the one copied there already this round."""
        b, offset = self.slot[key]
        bucket = self.buckets[b]
        param = self.sources[key].param
        grad = param.grad
        assert grad is not None, "hooked parameter without a gradient"
        param.grad = None
        flat = grad.reshape(-1)
        if add:
            target = bucket.buffer if bucket.solo else \
                bucket.buffer.narrow(0, offset, param.numel())  # type: ignore[union-attr]
            target.add_(flat.to(self.dtype), alpha=self.scale)  # type: ignore[union-attr]
            return
        if bucket.solo:  # reduce in the gradient's own memory (autograd gave it to us)
            same = flat.dtype == self.dtype and flat.is_contiguous()
            bucket.buffer = flat if same else flat.to(self.dtype)
            if self.scale != 1.0:
                bucket.buffer.mul_(self.scale)
            return
        view = bucket.buffer.narrow(0, offset, param.numel())  # type: ignore[union-attr]
        if self.scale == 1.0:
            view.copy_(flat)
        elif flat.dtype == view.dtype:
            torch.mul(flat, self.scale, out=view)
        else:
            view.copy_(flat).mul_(self.scale)

    def _open(self, b: int) -> None:
        """Give bucket ``b`` its slot buffer (draining the slot's last user)
        and copy in the gradients that arrived before it had one. A solo
        bucket takes a turn in the rotation too (so at most ``n_buffers``
        buckets hold memory) but uses its gradient as buffer."""
        slot = b % self.n_buffers
        previous = b - self.n_buffers
        if previous >= 0:
            self._drain(previous)
            self.before_reuse()
        bucket = self.buckets[b]
        bucket.opened = True
        if bucket.solo:
            pass
        elif self.contiguous:
            if self._slots[slot] is None:
                device = self.sources[bucket.keys[0]].param.device
                self._slots[slot] = torch.empty(self.buffer_numel, dtype=self.dtype,
                                                device=device)
            bucket.buffer = self._slots[slot].narrow(0, 0, bucket.numel)  # type: ignore[union-attr]
        else:
            device = self.sources[bucket.keys[0]].param.device
            bucket.buffer = torch.empty(bucket.numel, dtype=self.dtype, device=device)
        for key in bucket.ready:
            self._copy_in(key)

    def _launch(self, b: int) -> None:
        bucket = self.buckets[b]
        assert bucket.buffer is not None
        bucket.inflight = start_reduce_to_owners(bucket.buffer, bucket.ranges, self.group,
                                                 strategy=self.strategy)
        self._next = b + 1
        if self._next < len(self.buckets):
            self._open(self._next)

    def _drain(self, b: int) -> None:
        """Wait for bucket ``b``'s reduction; add this rank's ranges into the
        accumulators; release its buffer."""
        bucket = self.buckets[b]
        if bucket.inflight is None:
            return
        buffer = bucket.inflight.wait()
        bucket.inflight = None
        for group, shard_start, start, length in bucket.mine:
            self.land(group, shard_start, buffer.narrow(0, start, length))
        bucket.buffer, bucket.opened = None, False

    def finish(self) -> None:
        """End the round: launch what is left (missing gradients count as
        zeros), wait for everything, drain. No-op outside a round."""
        if not self._active:
            return
        try:
            for b in range(self._next, len(self.buckets)):
                bucket = self.buckets[b]
                assert bucket.opened, "bucket launched out of order"
                for key, offset in zip(bucket.keys, bucket.offsets):
                    if key in bucket.ready:
                        continue
                    param = self.sources[key].param
                    if bucket.solo:
                        bucket.buffer = torch.zeros(param.numel(), dtype=self.dtype,
                                                    device=param.device)
                    else:
                        bucket.buffer.narrow(0, offset, param.numel()).zero_()  # type: ignore
                self._launch(b)
            for b in range(len(self.buckets)):
                self._drain(b)
            if self._watch:
                self._reduce_extras()
            elif self.add_extra is not None:
                if self._notice is None:
                    self._notice = LateNotice(self.group, self.sources[0].param.device)
                self._notice.announce(self._late)
                self._late = -1
            self.on_round_end()
        finally:
            self._active = False

    def _reduce_extras(self) -> None:
        """End of a watched round: agree on which parameters some rank got
        extra gradients for, reduce those and add this rank's ranges into
        the accumulators; learn the largest counts (module docstring)."""
        n = len(self.sources)
        device = self.sources[0].param.device
        flags = [1 if k in self._extra else 0 for k in range(n)]
        agreed = torch.tensor(flags + self._count, dtype=torch.int64, device=device)
        collectives.all_reduce(agreed, op=dist.ReduceOp.MAX, group=self.group)
        values = agreed.tolist()
        self._expect = [max(e, c) for e, c in zip(self._expect, values[n:])]
        union = [k for k in range(n) if values[k]]
        self._had_extra = self._had_extra or bool(union)
        self._watch = self._had_extra or self._keep_watching
        if not union:
            return
        parts = [self._extra.get(k) for k in union]
        flat = torch.cat([t if t is not None else torch.zeros(
            self.sources[k].param.numel(), dtype=self.dtype, device=device)
            for k, t in zip(union, parts)])
        flat.mul_(self.scale)
        collectives.all_reduce(flat, group=self.group)
        start = 0
        for k in union:
            source = self.sources[k]
            layout = self.layouts[source.group]
            for owner, param_offset, length in layout.param_owners(source.index):
                if owner == self.rank:
                    shard = layout.offsets[source.index] + param_offset \
                        - self.rank * layout.partition_numel  # type: ignore[operator]
                    self.add_extra(source.group, shard,  # type: ignore[misc]
                                   flat.narrow(0, start + param_offset, length))
            start += source.param.numel()
        self._extra = {}

    @property
    def active(self) -> bool:
        """True between the first gradient of a backward and its end."""
        return self._active

    def reset(self) -> None:
        """Forget the current round (e.g. after a failed backward): wait for
        launched reductions without draining them."""
        for bucket in self.buckets:
            if bucket.inflight is not None:
                bucket.inflight.wait()
            bucket.inflight, bucket.buffer, bucket.ready = None, None, set()
            bucket.opened = False
        self._active = self._queued = False
        self._next = 0
        self._extra = {}
        self._late = -1

    def close(self) -> None:
        """Remove the hooks and free the buffers."""
        self.reset()
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._slots = [None] * self.n_buffers


def _append_merged(out: list[tuple[int, int, int, int]],
                   item: tuple[int, int, int, int]) -> None:
    """Append ``(group, shard start, buffer start, length)``, joining it to
    the previous range when both continue each other in shard and buffer."""
    if out:
        group, shard, start, length = out[-1]
        if group == item[0] and shard + length == item[1] and start + length == item[2]:
            out[-1] = (group, shard, start, length + item[3])
            return
    out.append(item)
