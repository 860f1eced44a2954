"""ZeRO stage 3's gradients, from autograd to the fp32 masters' ``.grad``.

:class:`Stage3Gradients` is the part of :class:`~.stage3.ZeroStage3` that
handles gradients between a backward and the step: the gradient hooks'
callbacks (:meth:`~Stage3Gradients._on_grad` hands each gradient to the
:class:`~.reduce3.ShardGradReducer`; one in no param group is dropped), the
leaf modules' gradients reduced together at the end of backward (zeros where
this rank's pass used none of a parameter), landing each reduced shard in its
master slice (a copy at its first landing in a step's first round, an add
after; under offload through :class:`~.offload.Landing`), the end of a
round, the accumulation boundary (:meth:`~Stage3Gradients.reduce_gradients`;
at world size 1 the flat gradient is the master gradient) and dropping every
gradient (:meth:`~Stage3Gradients.zero_grad`). It also gives
:class:`~.masters.MasterGradients` the master slices of each parameter and
its collectives, announced to the divergence guard.

It is a mixin: :class:`~.stage3.ZeroStage3` builds the state named below
(``__init__`` and ``_install_hooks``) and comes before
:class:`~.masters.MasterGradients` in the method order, so its
``_all_reduce`` and ``_param_slices`` are the ones used.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from dsrun.runtime.zero.divergence import DivergenceGuard
from dsrun.runtime.zero.fetch import ParamFetcher
from dsrun.runtime.zero.flat import FlatGrads, clear_flat_grads
from dsrun.runtime.zero.masters import reduce_on_device
from dsrun.runtime.zero.offload import Landing, Placement
from dsrun.runtime.zero.partitioned import zero_full_grad
from dsrun.runtime.zero.reduce3 import ShardGradReducer


class Stage3Gradients:
    """Stage 3's gradient handling (module docstring); state set by ZeroStage3."""

    masters: list[torch.nn.Parameter]
    group: Any
    world_size: int
    comm_device: torch.device
    guard: DivergenceGuard
    placement: Placement
    fetcher: ParamFetcher
    reducer: ShardGradReducer
    #: parameter id -> (master index, offset of its shard in that master)
    _slot: dict[int, tuple[int, int]]
    #: ids of the leaf modules' parameters: reduced at the end of backward
    _leaf_ids: frozenset[int]
    #: world size 1 without host residency: flat gradients, no hooks
    _local: bool
    _grads: list[Optional[FlatGrads]]
    _landing: Landing
    #: per master: the next round's writes are copies (a step's first round)
    _fresh: list[bool]
    #: ids of the parameters written in this step's first round
    _written: set[int]
    #: reduce_gradients() ran since the last step or zero_grad()
    _reduced: bool
    #: takes the edits of whole parameters' data (:mod:`~.whole_edits`)
    _take_edits: Callable[[], None]
    #: raises once a newer engine took the parameters (:mod:`~.ownership`)
    check_owner: Callable[[], None]

    def _on_grad(self, param: torch.Tensor) -> None:
        self.fetcher.begin_backward()
        if param.ds_id not in self._leaf_ids:  # a leaf's wait for the end of backward
            self.reducer.add(param)
        self.fetcher.after_grad(param)

    def _drop_grad(self, param: torch.Tensor) -> None:
        """A parameter in no param group: nothing trains it (as in
        DeepSpeed), so its full gradient goes at once."""
        self.fetcher.begin_backward()
        param.grad = None
        self.fetcher.after_grad(param)

    def _reduce_leaf_grads(self) -> None:
        """The gradients of every trainable parameter of the leaf modules that
        ran (:mod:`dsrun.utils.z3_leaf_module`), in module order, zero where
        this rank's pass gave none: the same reductions on every rank,
        whichever experts each one ran."""
        if self._local:
            return  # flat gradients, nothing reduced
        for p in self.fetcher.take_leaf_runs():
            if p.ds_id not in self._slot:
                continue  # frozen
            if p.grad is None:
                zero_full_grad(p)
            self.reducer.add(p)

    def _accumulator(self, param: torch.Tensor) -> torch.Tensor:
        g, offset = self._slot[param.ds_id]
        master = self.masters[g]
        if master.grad is None:
            master.grad = self._new_grad(master)
        return master.grad.narrow(0, offset, param.ds_spec.shard_numel)

    def _land(self, param: torch.Tensor, values: torch.Tensor) -> None:
        """Reduced gradient ``values`` of ``param``'s shard (a prefix of it
        at world size 1: the unpadded gradient) into its accumulator: a copy
        at its first landing in a step's first round (:attr:`_fresh`), an add
        afterwards. A parameter can land twice in one backward: one used
        inside a reentrant activation checkpoint lands in the checkpoint's
        nested pass and again in the outer pass or another checkpoint's
        (a shared block, a tied embedding); its second landing adds."""
        key = param.ds_id
        g, _ = self._slot[key]
        fresh = self._fresh[g] and key not in self._written
        if fresh:
            self._written.add(key)
        target = self._accumulator(param).narrow(0, 0, values.numel())
        self._landing.put(target, values, add=not fresh)

    def _finish_round(self) -> None:
        """End of a backward: flush the reduction; in a step's first round,
        zero the accumulator slices of parameters that got no gradient -
        every parameter with a master slice, also one frozen since
        initialize() (its slice would keep an earlier step's gradient).
        At world size 1 nothing lands: the flat gradient, which becomes the
        master gradient at the boundary (:meth:`_reduce_local`), holds this
        round's gradients already - zeroing "unwritten" slices would wipe
        them (a round opened by the hook of a parameter in no param group
        used to zero every step's gradients after the first)."""
        self._reduce_leaf_grads()
        self.reducer.finish()
        if self._local or not any(self._fresh):
            return
        for p in self._slotted():
            if p.ds_id not in self._written and self._fresh[self._slot[p.ds_id][0]]:
                self._accumulator(p).zero_()
        self._written.clear()
        self._fresh = [False] * len(self.masters)

    def micro_step_done(self) -> None:
        """After each backward: flush the reduction, release what backward
        left gathered (idempotent)."""
        self.fetcher.finish_backward()
        self.reducer.finish()

    def reduce_gradients(self) -> None:
        """At the accumulation boundary: every master ``.grad`` holds this
        rank's shards of the mean gradient. Idempotent until step/zero_grad."""
        self.check_owner()  # before the rebind of replaced data (whole_edits.py)
        if self._reduced:
            return
        self.micro_step_done()
        if self._local:
            self._take_edits()  # replaced data back onto the shards, before .grad is set
            self._reduce_local()
            self._arrived = any(grads.arrived for grads in self._grads if grads is not None)
        else:
            self._arrived = not all(self._fresh)  # a round ended: a backward gave gradients
            if any(self._fresh):  # no backward since zero_grad: nothing landed
                self._finish_round()
        self._landing.wait()  # under offload: the host now holds every gradient
        for master in self.masters:
            if master.grad is None:
                master.grad = self._new_grad(master)
        if self.placement.offload_param and self.placement.device.type == "cuda":
            # host shards are the masters: no gather copy may still read them
            torch.cuda.current_stream(self.placement.device).synchronize()
        self._fresh = [False] * len(self.masters)
        self._reduced = True

    def _reduce_local(self) -> None:
        """World size 1: the flat gradient is the master gradient (or is
        copied into it once per group)."""
        for g, grads in enumerate(self._grads):
            if grads is None:
                continue
            flat, master = grads.collect(), self.masters[g]
            if flat.dtype == master.dtype and flat.device == master.device:
                master.grad = flat
            else:
                self._landing.put(self._accumulator_of(g), flat, add=False)

    def _param_slices(self) -> list[tuple[Any, int, int, int]]:
        """Each trainable parameter's shard in the masters, as (parameter,
        master index, offset, length; padding included, which is zero)."""
        return [(p, *self._slot[p.ds_id], p.ds_spec.shard_numel) for p in self._slotted()]

    def _accumulator_of(self, g: int) -> torch.Tensor:
        master = self.masters[g]
        if master.grad is None:
            master.grad = self._new_grad(master)
        return master.grad

    def _all_reduce(self, value: torch.Tensor, op: Any, what: str) -> None:
        """Announced to the divergence guard first, like every stage-3 collective."""
        if self.world_size > 1:
            self.guard.event("step", what)
            reduce_on_device(value, op, self.group, self.comm_device)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop every gradient: model ``.grad``, a reduction in progress (and
        a backward that raised), the shard accumulators. ``set_to_none=False``
        (the engine's choice between steps) keeps the buffers: flat gradients
        (world size 1) stay bound and are zeroed, accumulators are kept
        unzeroed - the next round's first write to each slice is a copy."""
        self.fetcher.abandon_backward()
        self.reducer.reset()
        self._landing.wait()  # nothing may land in an accumulator after this
        clear_flat_grads(self._grads, set_to_none)
        if not self._local:
            for p in self.trainable_params():
                p.grad = None
        self._clear_master_grads(set_to_none, zero=False)
        self._written.clear()
        self._reduced = False
