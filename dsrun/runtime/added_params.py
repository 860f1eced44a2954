"""Stage 0: parameters a script puts into the optimizer after initialize().

At stage 0 the optimizer ``initialize()`` returns is the torch one, so a
script may call ``optimizer.add_param_group`` on it - Lightning's
``BaseFinetuning`` does, to unfreeze a backbone that was frozen and left
out of the optimizer. As with DDP and a torch optimizer, those parameters
must then be averaged over the data-parallel ranks, clipped and counted in
the global gradient norm, and under fp16 stepped through fp32 masters from
unscaled, overflow-checked gradients.

:class:`AddedParams` wraps that optimizer's ``add_param_group`` (an
instance attribute) so that the new parameters are covered at once: the
precision takes them (:meth:`~dsrun.runtime.precision_base.FullPrecision.track`;
fp16 replaces them in the group by fp32 masters, so a checkpoint loaded
next finds its optimizer state on the masters), and the gradient
all-reduce reduces them as late parameters
(:meth:`~dsrun.runtime.grad_sync.GradSync.add_late`). Parameters put into
``param_groups`` some other way are noticed by a change of the parameter
count before each backward and step (a few integer reads, nothing per
parameter). A parameter added between a synchronising backward and the
step has its gradient all-reduced at that step.

At ZeRO 1-3 the optimizer is dsrun's ZeRO optimizer over fixed flat
partitions, which has no ``add_param_group`` (an AttributeError, as in
DeepSpeed 0.19.8, whose message says why: :mod:`~.zero.unsupported`).
"""

from __future__ import annotations

import logging
import weakref
from typing import Any

import torch

from dsrun.runtime.sparse_grads import sparse_grad_params

log = logging.getLogger("dsrun")


def _count(optimizer: Any) -> tuple[int, int]:
    groups = optimizer.param_groups
    return len(groups), sum(len(g["params"]) for g in groups)


class AddedParams:
    """Watches a stage-0 engine's torch optimizer (module docstring)."""

    def __init__(self, engine: Any, optimizer: Any) -> None:
        self._engine = weakref.ref(engine)  # the engine holds the optimizer, which holds this
        self.optimizer = optimizer
        self._count = _count(optimizer)
        #: tensors of the groups that are not the module's (initialize() warned of these)
        self._foreign = _foreign(engine, optimizer)
        #: adopted since the last backward began: its reduction may not have covered them
        self._unreduced: list[torch.nn.Parameter] = []
        original = optimizer.add_param_group

        def add_param_group(param_group: dict[str, Any]) -> None:
            original(param_group)
            try:
                self.adopt()
            except Exception:
                optimizer.param_groups.pop()  # refused: the optimizer is as it was
                raise

        add_param_group.__doc__ = original.__doc__
        optimizer.add_param_group = add_param_group

    def adopt(self) -> None:
        """Cover what was put into the optimizer since the last call."""
        engine = self._engine()
        if engine is None or _count(self.optimizer) == self._count:
            return
        added = engine.precision.track(engine.module, self.optimizer)
        self._count = _count(self.optimizer)
        self._warn_foreign(engine)
        sync = engine._grad_sync
        if not added or sync is None:
            return
        sparse = {id(p) for _, p in sparse_grad_params(engine.module)}
        sync.sparse.extend(p for p in added if id(p) in sparse)
        dense = [p for p in added if id(p) not in sparse]
        if sync.world_size > 1:
            sync.add_late(dense)
            self._unreduced.extend(dense)

    def _warn_foreign(self, engine: Any) -> None:
        """A group added with tensors that are not the module's parameters
        (fp16 refuses them in track()): they are stepped with each rank's own
        gradient, as initialize() warns of such tensors."""
        foreign = _foreign(engine, self.optimizer)
        new = foreign - self._foreign
        self._foreign = foreign
        if new:
            log.warning("%d tensor(s) added to the optimizer's param groups are not parameters "
                        "of the module: they are stepped with each rank's own gradient, not "
                        "averaged across ranks (as in DeepSpeed); make them module parameters "
                        "to keep the replicas equal", len(new))

    def backward_started(self) -> None:
        """Before a backward: from its reduction on, the late list covers all."""
        self.adopt()
        self._unreduced.clear()

    def before_step(self, reduce_now: bool) -> None:
        """Before a step: with ``reduce_now`` (the backward all-reduce is on),
        all-reduce the gradients of parameters added since the last backward
        began, which its reduction did not cover."""
        self.adopt()
        engine = self._engine()
        if reduce_now and self._unreduced and engine is not None:
            engine._grad_sync.reduce_late(self._unreduced)
        self._unreduced.clear()


def _foreign(engine: Any, optimizer: Any) -> set[int]:
    """ids of the tensors in ``optimizer``'s groups that are neither a
    parameter of ``engine``'s module nor the tensor its precision steps for
    one (an fp16 master)."""
    own: set[int] = set()
    for param in engine.module.parameters():
        own.add(id(param))
        own.add(id(engine.precision.optimizer_tensor(param)))
    return {id(t) for g in optimizer.param_groups for t in g["params"]} - own
