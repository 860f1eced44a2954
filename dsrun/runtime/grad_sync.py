"""Data-parallel collectives of ZeRO stage 0: the initial parameter broadcast
and the bucketed gradient all-reduce, overlapped with backward (as DDP).

Data-parallel ranks must end every synchronising backward with the same
gradients: the mean over the group of each rank's gradient. :class:`GradSync`
gets there the way torch DDP's reducer does:

* **Buckets** (:func:`assign_buckets`, pure): trainable parameters, in
  reverse registration order (roughly the order backward produces their
  gradients), are packed into flat buffers of at most ``bucket_bytes``; a
  parameter larger than that gets a bucket of its own; a bucket holds one
  dtype.
* **Overlap**: a post-accumulate-grad hook on every parameter copies its
  gradient, pre-multiplied by ``1/world_size`` (exactly DDP's fused
  ``mul_out``), into its bucket slot. When a bucket is complete *and every
  bucket before it has been launched*, it is all-reduced with
  ``async_op=True``; gloo runs the reduction on its own worker threads
  while autograd keeps computing earlier layers' gradients (NCCL on its
  stream). Launching strictly in bucket order keeps the sequence of
  collectives identical on all ranks even if hooks fire in different orders.
* **Several gradients in one backward**: a parameter used inside a
  *reentrant* activation checkpoint (``use_reentrant=True``, HF
  ``gradient_checkpointing``'s default) gets its gradient in the
  checkpoint's nested pass, and another one if it is used again outside or
  in another checkpoint (a shared block, a tied embedding/head). Its slot
  must hold the sum, as DeepSpeed's stage 0 (which all-reduces after
  backward) has it. Each parameter expects one gradient per backward until
  it is seen to get more: a gradient past the expected count is an
  **extra** one - the slot was filled, perhaps already reduced, with a
  partial sum - so at the end of backward the final gradients of those
  parameters are all-reduced again, together (param order, one flat tensor
  per dtype), over their slots; and the parameter then expects that many,
  so later backwards fill its slot at its last gradient and send nothing
  more. Ranks may reuse a parameter a different number of times (a
  data-dependent number of applications of a shared checkpointed block),
  so whether that reduction runs, and over which parameters, is decided
  together: the last bucket carries one more element, each rank's "I got
  extra gradients" flag, and is launched by :meth:`GradSync.finish` (its
  gradients are backward's last anyway); when the reduced flag says any
  rank got one, every rank all-reduces (MAX) its per-parameter counts and
  flags, and reduces the union, a rank without extra gradients for a
  parameter contributing its final ``.grad`` (zeros if none); the
  expected counts become the largest. Cost: nothing more in the common
  case on CPU. On an accelerator reading the flag waits for the reductions
  (one host sync): done in the first synchronising backward, then only
  while some rank has had extra gradients (a model that reuses parameters
  through reentrant checkpoints); otherwise an extra gradient first seen
  in a later backward is refused with an error, on the rank that got it,
  since the other ranks no longer look. The first backward with extra
  gradients sends those parameters twice, the second time after backward;
  later ones launch that parameter's bucket, and the buckets after it,
  only once its last gradient has come - at worst after backward, where
  DeepSpeed's stage 0 reduces everything.
* **Finish** (after ``loss.backward()`` returns): buckets not yet launched
  are launched in order - a parameter that got no gradient this backward
  contributes the one it accumulated in earlier micro-steps or ``no_sync()``
  backwards, or zeros if it has none (as DeepSpeed) - every handle is waited on, and each
  parameter's ``.grad`` becomes a view of its slot (no copy back) - or is
  copied from it when the communication dtype differs from the gradient's.
  A parameter frozen since (``requires_grad`` False) that got no gradient
  keeps ``.grad`` None (its zeros still fill the slot, so every rank
  reduces the same buckets): the optimizer does not step it, as in torch
  and DeepSpeed.
* **Late** parameters (``late``: frozen when the buckets were laid out,
  in the optimizer all the same) have no bucket: once one is trainable,
  its gradient (zeros where a rank has none) is all-reduced after the
  buckets, one flat tensor per dtype, in module order - so unfreezing
  one trains it on every rank alike, with no gradient memory before then.
  Parameters put into the optimizer later (``add_param_group``) join them
  (:meth:`GradSync.add_late`).
* **Sparse** parameters (``sparse``: the weights of ``nn.Embedding`` /
  ``nn.EmbeddingBag`` built with ``sparse=True``) have no bucket either:
  after the rest, their sparse gradients are all-gathered and averaged as
  DeepSpeed does (:mod:`~dsrun.runtime.sparse_grads`), and handed back
  sparse. A sparse gradient on any other parameter is made dense into its
  bucket slot.

Hooks act only between :meth:`GradSync.arm` and :meth:`GradSync.finish`;
backward passes outside (gradient accumulation micro-steps, ``no_sync()``,
``engine.enable_backward_allreduce = False``, user code calling
``loss.backward()`` directly) only accumulate locally.
:meth:`GradSync.all_reduce_accumulated` averages what they accumulated
afterwards (``engine.allreduce_gradients()``): the same buckets, fill and
launch order as a synchronising backward whose hooks all came late, so the
result is bitwise the one that backward would have left.

With 2 ranks the result is bitwise what DDP computes: the same
``grad * (1/2)`` products, and ``a + b == b + a`` in IEEE arithmetic
whatever the bucket layout. With more ranks the order in which a ring
all-reduce adds the contributions depends on where an element sits in its
bucket, so results can differ from DDP in the last bit.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist

from dsrun import comm as collectives
from dsrun.errors import DsrunError
from dsrun.runtime.sparse_grads import reduce_sparse

log = logging.getLogger(__name__)

# DDP's bucket_cap_mb default: small enough to overlap, large enough to amortise latency.
DEFAULT_BUCKET_BYTES = 25 * 1024 * 1024


def assign_buckets(numels: Sequence[int], element_sizes: Sequence[int],
                   dtypes: Sequence[Any], bucket_bytes: int) -> list[list[int]]:
    """Group parameter indices into buckets, in the given order (pure).

    Consecutive parameters of one dtype share a bucket until adding the next
    would exceed ``bucket_bytes``; a parameter bigger than the cap is alone.
    Buckets are returned in the order of their first parameter, and every
    index appears exactly once.
    """
    if not len(numels) == len(element_sizes) == len(dtypes):
        raise ValueError("numels, element_sizes and dtypes must have equal lengths")
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    open_buckets: dict[Any, tuple[list[int], int]] = {}
    done: list[list[int]] = []
    for index, (numel, size, dtype) in enumerate(zip(numels, element_sizes, dtypes)):
        nbytes = numel * size
        members, used = open_buckets.get(dtype, ([], 0))
        if members and used + nbytes > bucket_bytes:
            done.append(members)
            members, used = [], 0
        members.append(index)
        open_buckets[dtype] = (members, used + nbytes)
    done.extend(members for members, _ in open_buckets.values() if members)
    return sorted(done, key=lambda members: members[0])


@dataclass
class _Bucket:
    indices: list[int]  # into GradSync.params
    offsets: list[int]
    buffer: torch.Tensor
    pending: int = 0  # parameters whose slot is not filled yet this backward
    work: Optional[Any] = None


class GradSync:
    """Averages gradients over ``group`` in overlapped buckets (module docstring)."""

    def __init__(self, params: Sequence[torch.nn.Parameter], *, group: Any = None,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                 comm_dtype: Optional[torch.dtype] = None, predivide: float = 0.0,
                 names: Optional[Sequence[str]] = None,
                 late: Sequence[torch.nn.Parameter] = (),
                 sparse: Sequence[torch.nn.Parameter] = ()) -> None:
        """``predivide``: divide by this before the reduction and by
        ``world_size / predivide`` after (DeepSpeed's gradient_predivide_factor);
        0 means divide by the world size before, as DDP does. ``sparse``
        gradients are divided by the world size alone (module docstring)."""
        self.params = list(params)
        self.late = list(late)
        self.sparse = list(sparse)
        self.names = list(names) if names is not None else [str(i) for i in range(len(params))]
        self.group = group
        self.world_size = dist.get_world_size(group)
        self.comm_dtype = comm_dtype
        factor = predivide or float(self.world_size)
        self.pre_scale = 1.0 / factor
        self.post_scale = factor / self.world_size
        order = list(reversed(range(len(self.params))))  # backward order, roughly
        dtypes = [self._dtype(self.params[i]) for i in order]
        layout = assign_buckets([self.params[i].numel() for i in order],
                                [torch.empty((), dtype=d).element_size() for d in dtypes],
                                dtypes, bucket_bytes)
        self.buckets = [self._make_bucket([order[j] for j in members], spare=b == len(layout) - 1)
                        for b, members in enumerate(layout)]
        self.slot = {i: (b, k) for b, bucket in enumerate(self.buckets)
                     for k, i in enumerate(bucket.indices)}
        self._bucket_of = [self.slot[i][0] for i in range(len(self.params))]
        #: per parameter: gradients it got in this synchronising backward, and
        #: how many it gets per backward (learned, "Several gradients")
        self._landed = [0] * len(self.params)
        self._expect = [1] * len(self.params)
        self._extra: list[int] = []  # parameters given an extra gradient this backward
        #: whether finish() reads the reduced extra-gradient flag (module
        #: docstring), and whether it keeps reading it (on CPU it costs nothing)
        self._probe = bool(self.buckets)
        self._keep_probing = self._probe and self.buckets[-1].buffer.device.type == "cpu"
        self._backward = True  # this round is a backward's, not all_reduce_accumulated's
        self._armed = False
        self._next = 0
        self._handles = [p.register_post_accumulate_grad_hook(self._hook(i))
                         for i, p in enumerate(self.params)]
        log.debug("grad sync: %d parameters in %d bucket(s) of <= %d bytes", len(self.params),
                  len(self.buckets), bucket_bytes)

    def _dtype(self, param: torch.Tensor) -> torch.dtype:
        return self.comm_dtype or param.dtype

    def _make_bucket(self, indices: list[int], spare: bool = False) -> _Bucket:
        """``spare``: one more element, after the slots (the last bucket's
        extra-gradient flag, module docstring)."""
        offsets, total = [], 0
        for i in indices:
            offsets.append(total)
            total += self.params[i].numel()
        first = self.params[indices[0]]
        buffer = torch.zeros(total + int(spare), dtype=self._dtype(first), device=first.device)
        return _Bucket(indices=indices, offsets=offsets, buffer=buffer)

    def _hook(self, index: int) -> Any:
        def on_grad(param: torch.Tensor) -> None:
            if self._armed:
                self._mark_ready(index, param)
        return on_grad

    def _view(self, index: int) -> torch.Tensor:
        b, k = self.slot[index]
        bucket = self.buckets[b]
        start = bucket.offsets[k]
        return bucket.buffer[start:start + self.params[index].numel()]

    def arm(self) -> None:
        """The next backward is a synchronising one."""
        for bucket in self.buckets:
            if bucket.work is not None:
                raise DsrunError("gradient all-reduce armed again before the last one finished")
            bucket.pending = len(bucket.indices)
        if self.buckets:  # the last one waits for finish(), which sets its flag
            self.buckets[-1].pending += 1
        self._landed = [0] * len(self.params)
        self._extra = []
        self._next = 0
        self._armed = True

    def _mark_ready(self, index: int, param: torch.Tensor) -> None:
        """A gradient of ``param`` was accumulated: at the expected count its
        slot is filled (``param.grad`` holds the sum) and complete buckets
        launch; before, more are coming; after, it is an extra one."""
        landed = self._landed[index] + 1
        self._landed[index] = landed
        expect = self._expect[index]
        if landed != expect:
            if landed > expect:
                self._extra_gradient(index, param)
            return
        assert param.grad is not None
        self._fill(index, param.grad)
        bucket = self.buckets[self._bucket_of[index]]
        bucket.pending -= 1
        while self._next < len(self.buckets) and self.buckets[self._next].pending == 0:
            self._launch(self._next)

    def _extra_gradient(self, index: int, param: torch.Tensor) -> None:
        """A gradient past the expected count (module docstring, "Several
        gradients"): reduced again at the end of backward. Not when autograd
        accumulated it into the slot itself (``.grad`` still the reduced
        gradient of an earlier synchronising backward, no zero_grad between):
        that memory was filled and may be in a reduction."""
        grad = param.grad
        buffer = self.buckets[self._bucket_of[index]].buffer
        if grad is not None and grad.untyped_storage().data_ptr() == \
                buffer.untyped_storage().data_ptr():
            raise DsrunError(
                f"parameter {self.names[index]} received another gradient in this synchronising "
                "backward after its all-reduce was prepared, while its .grad was still the "
                "all-reduced gradient of an earlier backward: zero the gradients between "
                "synchronising backwards (engine.step() does). A second gradient comes from a "
                "parameter used inside a reentrant activation checkpoint and again outside it "
                "or in another checkpoint (a shared layer, a tied weight); "
                "use_reentrant=False avoids it")
        if self._landed[index] == self._expect[index] + 1:  # its first extra one
            self._extra.append(index)

    def _fill(self, index: int, grad: torch.Tensor) -> None:
        self._scaled_into(self._view(index), grad)

    def _scaled_into(self, view: torch.Tensor, grad: torch.Tensor) -> None:
        # a sparse gradient where none was expected (module docstring): densified
        flat = (grad.to_dense() if grad.is_sparse else grad).reshape(-1)
        if self.pre_scale == 1.0:
            view.copy_(flat)
        else:
            torch.mul(flat, self.pre_scale, out=view)

    def _launch(self, b: int) -> None:
        bucket = self.buckets[b]
        bucket.work = collectives.all_reduce(bucket.buffer, group=self.group, async_op=True)
        self._next = b + 1

    def finish(self) -> None:
        """Launch what is left, wait for every reduction, hand results to ``.grad``."""
        if not self._armed:
            return
        self._armed = False
        landed, expect = self._landed, self._expect
        for b in range(self._next, len(self.buckets)):
            bucket = self.buckets[b]
            for index in bucket.indices:
                if landed[index] >= expect[index]:
                    continue  # filled
                if landed[index]:  # fewer gradients than the last backward's: expect these
                    expect[index] = landed[index]
                # the sum so far, or what earlier micro-steps accumulated, or zeros
                grad = self.params[index].grad
                if grad is None:
                    self._view(index).zero_()
                else:
                    self._fill(index, grad)
            if b == len(self.buckets) - 1:
                bucket.buffer[-1] = 1.0 if self._extra else 0.0
            self._launch(b)
        for bucket in self.buckets:
            work, bucket.work = bucket.work, None
            work.wait()
            if self.post_scale != 1.0:
                bucket.buffer.mul_(self.post_scale)
        if self.buckets:
            self._agree_extra()
        for bucket in self.buckets:
            for index in bucket.indices:
                param = self.params[index]
                if param.grad is not None or param.requires_grad:
                    self._hand_back(index)  # else frozen since: no gradient, no step
        self._reduce_late()
        if self.sparse:
            reduce_sparse(self.sparse, group=self.group, comm_dtype=self.comm_dtype)

    def _agree_extra(self) -> None:
        """Decide with the other ranks whether any got extra gradients this
        backward (the last bucket's reduced flag, module docstring) and if
        so reduce the union of those parameters on every rank."""
        local, self._extra = self._extra, []
        if not self._probe:
            if local:
                self._refuse_late_extra(local)
            return
        # every rank reads the same reduced flag, so all decide alike
        anyone = bool(self.buckets[-1].buffer[-1].item() > 0)
        if anyone:
            self._keep_probing = True
        elif self._backward and not self._keep_probing:
            self._probe = False  # no rank reuses parameters: spare the host sync
            return
        if not anyone:
            return
        n = len(self.params)
        counts = torch.zeros(2 * n, dtype=torch.int64, device=self.buckets[-1].buffer.device)
        counts[:n] = torch.tensor(self._landed, dtype=torch.int64)
        if local:
            counts[n + torch.tensor(local, dtype=torch.int64)] = 1
        collectives.all_reduce(counts, op=dist.ReduceOp.MAX, group=self.group)
        most, union = counts[:n].tolist(), counts[n:].nonzero().flatten().tolist()
        for index in union:
            self._expect[index] = most[index]
        self._reduce_extra(union)

    def _refuse_late_extra(self, local: list[int]) -> None:
        names = ", ".join(self.names[i] for i in sorted(local)[:5])
        raise DsrunError(
            f"parameter(s) {names} received more than one gradient in this synchronising "
            "backward (a parameter used inside a reentrant activation checkpoint and again "
            "outside it or in another checkpoint), but no rank got one in the first "
            "synchronising backward, so the ranks no longer check for them on this device "
            "(a host sync per step): reuse them from the first step on, or use "
            "use_reentrant=False")

    def _reduce_extra(self, extra: list[int]) -> None:
        """All-reduce again, over their slots, the final gradients of the
        parameters ``extra`` (the union over the ranks of those that got
        extra ones, module docstring, "Several gradients"), in param order."""
        by_dtype: dict[torch.dtype, list[int]] = {}
        for index in sorted(extra):
            by_dtype.setdefault(self._dtype(self.params[index]), []).append(index)
        for dtype, indices in by_dtype.items():
            sizes = [self.params[i].numel() for i in indices]
            flat = torch.empty(sum(sizes), dtype=dtype, device=self.params[indices[0]].device)
            for i, part in zip(indices, flat.split(sizes)):
                grad = self.params[i].grad
                if grad is None:  # unused on this rank
                    part.zero_()
                    continue
                if grad.untyped_storage().data_ptr() == \
                        self._view(i).untyped_storage().data_ptr():
                    raise DsrunError(
                        f"parameter {self.names[i]} got extra gradients on another rank in this "
                        "synchronising backward, and its .grad here is still the all-reduced "
                        "gradient of an earlier backward: zero the gradients between "
                        "synchronising backwards (engine.step() does)")
                self._scaled_into(part, grad)
            collectives.all_reduce(flat, group=self.group)
            if self.post_scale != 1.0:
                flat.mul_(self.post_scale)
            for i, part in zip(indices, flat.split(sizes)):
                self._view(i).copy_(part)

    def add_late(self, params: Sequence[torch.nn.Parameter]) -> None:
        """Reduce ``params`` (put into the optimizer after initialize():
        ``add_param_group``) as late parameters from the next backward on."""
        self.late.extend(params)

    def reduce_late(self, params: Sequence[torch.nn.Parameter]) -> None:
        """All-reduce the gradients of late ``params`` now (added after the
        last synchronising backward, whose reduction did not cover them)."""
        self._reduce_late(params)

    def _reduce_late(self, params: Optional[Sequence[torch.nn.Parameter]] = None) -> None:
        """All-reduce the gradients of the late parameters (or of ``params``)
        trainable now (module docstring), one flat tensor per dtype."""
        live = [p for p in (self.late if params is None else params) if p.requires_grad]
        by_dtype: dict[torch.dtype, list[torch.nn.Parameter]] = {}
        for p in live:
            by_dtype.setdefault(self._dtype(p), []).append(p)
        for dtype, params in by_dtype.items():
            flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p))
                              .reshape(-1).to(dtype) for p in params])
            flat.mul_(self.pre_scale)
            collectives.all_reduce(flat, group=self.group)
            if self.post_scale != 1.0:
                flat.mul_(self.post_scale)
            offset = 0
            for p in params:
                p.grad = flat[offset:offset + p.numel()].view_as(p).to(p.dtype)
                offset += p.numel()

    def _hand_back(self, index: int) -> None:
        param = self.params[index]
        view = self._view(index).view_as(param)
        if view.dtype == param.dtype:
            param.grad = view
        elif param.grad is None:
            param.grad = view.to(param.dtype)
        else:
            param.grad.copy_(view)

    def all_reduce_accumulated(self) -> None:
        """Average every parameter's current ``.grad`` (zeros where None) now,
        outside backward (module docstring)."""
        self.arm()
        self._backward = False
        try:
            self.finish()
        finally:
            self._backward = True

    @property
    def armed(self) -> bool:
        """Armed and not yet finished (or disarmed)."""
        return self._armed

    def disarm(self) -> None:
        """Backward failed: forget this round (launched reductions are left to finish)."""
        self._armed = False
        self._extra = []
        for bucket in self.buckets:
            bucket.work = None

    def close(self) -> None:
        """Remove the hooks (the engine is being discarded)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []


def broadcast_tensors(tensors: Sequence[torch.Tensor], *, group: Any = None, src: int = 0,
                      bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> None:
    """Overwrite ``tensors`` with group rank ``src``'s values on every rank of
    ``group``, coalesced into flat buffers of at most ``bucket_bytes`` per dtype."""
    source = dist.get_global_rank(group, src) if group is not None else src
    layout = assign_buckets([t.numel() for t in tensors], [t.element_size() for t in tensors],
                            [(t.dtype, t.device) for t in tensors], bucket_bytes)
    with torch.no_grad():
        for members in layout:
            chunk = [tensors[i] for i in members]
            flat = torch.cat([t.detach().reshape(-1) for t in chunk])
            collectives.broadcast(flat, src=source, group=group)
            offset = 0
            for tensor in chunk:
                tensor.copy_(flat[offset:offset + tensor.numel()].view_as(tensor))
                offset += tensor.numel()
