"""ZeRO stage 3 parameter fetching: module hooks that gather partitioned
parameters just before they are used and release them just after.

Every module that directly owns a non-persistent partitioned parameter (or
has external ones, :func:`~.init.register_external_parameter`) gets:

* a **forward pre-hook**: gather the module's parameters (one
  :class:`~.divergence.DivergenceGuard` event, then async all-gathers), then
  prefetch, then wait for its own;
* a **forward hook**: release them (once no running forward of the module
  uses them), and hook the outputs that require grad;
* an **output gradient hook** (fires when the gradient of the module's
  output is known, i.e. just before the module's own backward runs): gather
  the parameters again, prefetch by the backward trace.

In backward a trainable parameter is released by :meth:`ParamFetcher.after_grad`
(the owner's post-accumulate-grad hook, after its gradient was reduced):
autograd accumulates a parameter's gradient only after every use of it in
the graph, so nothing needs it afterwards. Frozen parameters and anything
left are released when backward ends (an autograd engine callback queued at
the first hook of the round). The root module's forward hook releases what a
forward pass left (e.g. prefetched and not used).

**Prefetch**, **the turn from forward to backward** and **reuse distance**
(what is gathered ahead, and kept from forward for backward):
:mod:`~.fetch_prefetch`.

**Activation checkpointing.** A module forward that runs while autograd
runs a backward (``torch._C._current_graph_task_id() != -1``) is a
checkpoint's recomputation - ``torch.utils.checkpoint`` reentrant or not,
``deepspeed.checkpointing``. Its pre-hook gathers the module's parameters
(a ``recompute`` guard event: every rank recomputes the same modules),
leaves the forward trace and prefetching alone, and its post-hook
does not release them: the backward the recomputation serves runs next and
uses them (the module's own output hook may already have fired - it is what
started the recomputation). :meth:`ParamFetcher.after_grad` releases them,
or the end of backward.

**A parameter read outside its module's forward** (``x @
self.emb.weight.t()`` in a parent's forward, a tied head): while a hooked
module's forward runs, reading a released parameter through a module
attribute gathers it (one guard event, like any gather) and registers it as
an external parameter of the innermost hooked module running
(:func:`~.init.register_external_parameter`), as DeepSpeed's
``ZeROOrderedDict`` does: from the next pass on that module's pre-hook
gathers it with its own, its backward too, and its post-hook releases it.
The modules' ``_parameters`` dicts are :class:`GatheringParameters` for that
while the hooks are installed (plain dicts again after :meth:`ParamFetcher.close`;
a copy or pickle of the module gets a plain dict). A read that does not go
through the module attribute (a parameter kept in a list or a closure) is
not seen: register it yourself.

Autograd keeps the parameter object itself for backward (a leaf is saved by
reference), so emptying ``param.data`` after forward and refilling it
before backward is invisible to it. An operator that saves a *view* of a
parameter keeps that storage alive until backward: ``F.linear`` does
(``weight.t()``), so while the hooks are installed,
``torch.nn.functional.linear`` is :func:`~.linear.zero3_linear`, which saves
the parameter itself for the root's partitioned weights - not those kept
whole (``memory_efficient_linear``, as in DeepSpeed). It decides by the weight,
so a checkpoint's recomputation - inside a hooked module or not - saves
what the original forward saved. Other operators that save a view of a
weight still keep it until backward.

A module compiled before ``initialize()`` in the tree the hooks cover is
refused when they are installed (:mod:`~.compiled`); a deep copy of a hooked
module keeps the hooks, which do nothing for it.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from collections.abc import Set as AbstractSet
from typing import Any, Callable, Optional

import torch

from dsrun.errors import DsrunError
from dsrun.runtime.zero import linear
from dsrun.runtime.zero.comm import CommStrategy
from dsrun.runtime.zero.compiled import refuse_compiled
from dsrun.runtime.zero.divergence import DivergenceGuard
from dsrun.runtime.zero.fetch_prefetch import FetchPlanning
from dsrun.runtime.zero.fetch_walk import external_params, hooked_modules, output_tensors
from dsrun.runtime.zero.init import register_external_parameter
from dsrun.runtime.zero.partitioned import (
    ZeroParamStatus,
    finish_gather,
    is_zero_param,
    param_name,
    release,
    start_gathers,
)
from dsrun.runtime.zero.stage3_plan import LiveSet, TraceCursor
from dsrun.runtime.zero.whole_edits import take_gathered_edit
from dsrun.utils.z3_leaf_module import (
    mark_leaf_parameters,
    unmark_leaf_parameters,
    z3_leaf_module,
)

log = logging.getLogger("dsrun.runtime.zero")

_READING: list[ParamFetcher] = []  # fetchers inside a hooked forward, innermost last


def _in_autograd() -> bool:
    """True while autograd's engine runs a backward on this thread: a module
    forward there is activation checkpointing's recomputation."""
    return torch._C._current_graph_task_id() != -1


class GatheringParameters(dict):
    """A module's ``_parameters`` that gathers a released partitioned
    parameter read during a hooked forward (module docstring)."""

    __slots__ = ()

    def __getitem__(self, key: str) -> Any:
        param = dict.__getitem__(self, key)
        status = getattr(param, "ds_status", None)
        if (_READING and status is not None and status is not ZeroParamStatus.AVAILABLE
                and not torch.compiler.is_compiling()):
            _READING[-1].fetch_read(param)
        return param

    def __reduce__(self) -> Any:
        return dict, (dict(self),)


class ParamFetcher(FetchPlanning):
    """Gather/release/prefetch hooks over ``root`` (module docstring)."""

    def __init__(self, root: torch.nn.Module, *, guard: DivergenceGuard,
                 prefetch_bucket: int, max_live: int, max_reuse: int = 0,
                 strategy: Optional[CommStrategy] = None,
                 memory_efficient_linear: bool = True) -> None:
        self.root = root
        self.guard = guard
        self.strategy = strategy
        self.prefetch_bucket = prefetch_bucket
        self.max_live = max_live
        self.max_reuse = max_reuse
        self.modules: list[torch.nn.Module] = []
        self.names: list[str] = []
        self._direct: list[tuple[torch.Tensor, ...]] = []
        self.leaves: dict[int, tuple[torch.Tensor, ...]] = {}  # index -> its subtree's params
        for name, module in hooked_modules(root):
            leaf = z3_leaf_module(module)
            own = tuple(p for p in module.parameters(recurse=leaf) if is_zero_param(p))
            if module is root or own or self._externals(module):
                if leaf:
                    self.leaves[len(self.modules)] = own
                    mark_leaf_parameters(module)
                self.modules.append(module)
                self.names.append(f"{name or '<root>'} ({type(module).__name__}"
                                  f"{', leaf' if leaf else ''})")
                self._direct.append(own)
        self._leaf_runs: dict[int, None] = {}  # leaves run with grad since the last take
        self._running: list[int] = []  # hooked modules inside their forward, innermost last
        self.by_id: dict[int, torch.Tensor] = {
            p.ds_id: p for p in root.parameters() if is_zero_param(p)}
        self._numels = {pid: p.ds_numel for pid, p in self.by_id.items()}
        self.active = any(not p.ds_persist for p in self.by_id.values())
        self.live = LiveSet()
        limit = 4 * len(self.modules) + 16
        self.forward_trace, self.backward_trace = TraceCursor(limit), TraceCursor(limit)
        self._users: dict[int, int] = {}
        self._fetchable: dict[int, tuple[int, tuple[torch.Tensor, ...]]] = {}
        self._turn_keep: frozenset[int] = frozenset()  # ids kept from forward to backward
        self._reuse_keep: frozenset[int] = frozenset()  # kept by the reuse distance
        self._turn_from = 0  # forward-trace position from which they are kept
        self._last_use: dict[int, int] = {}  # id -> last forward-trace position using it
        self._root_depth = 0
        self._in_backward = False
        self._round = 0
        self._end_hooks: list[Callable[[], None]] = []
        self._handles: list[Any] = []
        if self.active or self.leaves:  # leaves: their runs decide what backward reduces
            refuse_compiled(root, self.modules)
            for index, module in enumerate(self.modules):
                self._handles.append(module.register_forward_pre_hook(
                    self._pre_hook(index), prepend=True))
                self._handles.append(module.register_forward_hook(
                    self._post_hook(index), always_call=True))
            for module in root.modules():
                if type(module.__dict__.get("_parameters")) is dict:
                    module._parameters = GatheringParameters(module._parameters)
        # F.linear saving the weight itself, decided per weight (module docstring);
        # persistence is fixed at initialize(), so forward and recomputation agree
        self._linear_marked = tuple(p for p in self.by_id.values() if not p.ds_persist) \
            if self._handles and memory_efficient_linear else ()
        self._linear_holder: Optional[linear.Holder] = None
        if self._linear_marked:
            linear.mark(self._linear_marked, True)
            self._linear_holder = linear.install()

    # ------------------------------------------------------------- queries

    def _externals(self, module: torch.nn.Module) -> tuple[torch.Tensor, ...]:
        """External parameters of ``module`` - of its whole subtree for a leaf."""
        if not z3_leaf_module(module):
            return external_params(module)
        return tuple(p for sub in module.modules() for p in external_params(sub))

    def fetchable(self, index: int) -> tuple[torch.Tensor, ...]:
        """Module ``index``'s partitioned, non-persistent parameters (its own
        - a leaf's subtree's - and its external ones), each once."""
        external = self._externals(self.modules[index])
        cached = self._fetchable.get(index)
        if cached is not None and cached[0] == len(external):
            return cached[1]
        params = self._direct[index] + external
        out = tuple({id(p): p for p in params if is_zero_param(p) and not p.ds_persist}
                    .values())
        for p in out:
            if p.ds_id not in self.by_id:  # an external parameter from outside the root
                self.by_id[p.ds_id], self._numels[p.ds_id] = p, p.ds_numel
        self._fetchable[index] = (len(external), out)
        return out

    def leaf_params(self) -> tuple[torch.Tensor, ...]:
        """Every partitioned parameter inside a hooked leaf module, each once."""
        return tuple({id(p): p for params in self.leaves.values() for p in params}.values())

    def take_leaf_runs(self) -> tuple[torch.Tensor, ...]:
        """The parameters of the leaves whose forward ran with grad enabled
        since the last call (module order, each once); forgets them. Every
        rank that ran the same modules answers the same list."""
        runs, self._leaf_runs = sorted(self._leaf_runs), {}
        return tuple({id(p): p for index in runs for p in self.leaves[index]}.values())

    def on_backward_end(self, hook: Callable[[], None]) -> None:
        """Run ``hook`` at the end of every backward, before the release."""
        self._end_hooks.append(hook)

    # --------------------------------------------------------------- hooks

    # A copy.deepcopy of a hooked module keeps these hooks (a function is not
    # copied): they act only for the module they were installed on, so the
    # copy's forward does not gather (collectively) the original's parameters.

    def _pre_hook(self, index: int) -> Callable[..., None]:
        def hook(module: torch.nn.Module, args: Any) -> None:
            if module is self.modules[index]:
                self._pre_forward(index)
        return hook

    def _post_hook(self, index: int) -> Callable[..., None]:
        def hook(module: torch.nn.Module, args: Any, output: Any) -> None:
            if module is self.modules[index]:
                self._post_forward(index, output)
        return hook

    def _pre_forward(self, index: int) -> None:
        if not self._running:
            _READING.append(self)
        self._running.append(index)
        if _in_autograd():
            self._pre_recompute(index)
            return
        if self.modules[index] is self.root:
            if self._root_depth == 0:
                self._release_unused(reset_users=True)
                self.forward_trace.start_pass()
                self._plan_turn()
            self._root_depth += 1
        if index in self.leaves and torch.is_grad_enabled():
            self._leaf_runs[index] = None
        on_track = self.forward_trace.visit(index)
        params = self.fetchable(index)
        for p in params:
            self._users[p.ds_id] = self._users.get(p.ds_id, 0) + 1
        self._fetch(index, params, "forward", ahead=False)
        if on_track:
            self._prefetch(self.forward_trace, "forward prefetch")
        for p in params:
            finish_gather(p)

    def _post_forward(self, index: int, output: Any) -> None:
        if index in self._running:  # also unwinds modules whose forward raised
            del self._running[len(self._running) - 1 - self._running[::-1].index(index):]
            if not self._running and self in _READING:
                _READING.remove(self)
        if _in_autograd():
            self._post_recompute(index, output)
            return
        params = self.fetchable(index)
        for p in params:
            users = self._users.get(p.ds_id, 1) - 1
            self._users[p.ds_id] = max(users, 0)
            if users <= 0:
                if self._keeps(p):
                    self.live.mark_ahead(p.ds_id)
                else:
                    self._release(p)
        if params and torch.is_grad_enabled():
            self._hook_outputs(index, output)
        if self.modules[index] is self.root:
            self._root_depth = max(self._root_depth - 1, 0)
            if self._root_depth == 0:
                self._release_unused(reset_users=False, keep=self._turn_keep | self._reuse_keep
                                     if torch.is_grad_enabled() else frozenset())

    def _pre_recompute(self, index: int) -> None:
        """A module's forward inside backward: activation checkpointing
        recomputing it (module docstring). Gather its parameters (every rank
        recomputes the same modules) without touching the forward trace or
        prefetching."""
        self.begin_backward()
        if index in self.leaves and torch.is_grad_enabled():
            self._leaf_runs[index] = None
        params = self.fetchable(index)
        for p in params:
            self._users[p.ds_id] = self._users.get(p.ds_id, 0) + 1
        self._fetch(index, params, "recompute", ahead=False)
        for p in params:
            finish_gather(p)

    def _post_recompute(self, index: int, output: Any) -> None:
        """End of a recomputed forward: keep its parameters - the backward
        about to run uses them - until :meth:`after_grad` (trainable) or the
        end of backward (frozen) releases them."""
        for p in self.fetchable(index):
            self._users[p.ds_id] = max(self._users.get(p.ds_id, 1) - 1, 0)
        if torch.is_grad_enabled():  # reentrant checkpointing backpropagates these outputs
            self._hook_outputs(index, output)

    def fetch_read(self, param: torch.Tensor) -> None:
        """A released (or in-flight) ``param`` was read in the forward of the
        innermost hooked module running: it becomes that module's external
        parameter and is gathered now (module docstring)."""
        index = self._running[-1]
        register_external_parameter(self.modules[index], param)
        log.debug("ZeRO-3: %s read in the forward of %s: registered as its external "
                  "parameter", param_name(param), self.names[index])
        self._fetch(index, (param,), "forward", ahead=False)
        finish_gather(param)

    def _hook_outputs(self, index: int, output: Any) -> None:
        tensors = [t for t in output_tensors(output) if t.requires_grad]
        if not tensors:
            return
        fired = {"round": -1}  # one gather per backward round, however many outputs

        def on_output_grad(grad: torch.Tensor) -> None:
            self.begin_backward()
            if fired["round"] != self._round:
                fired["round"] = self._round
                self._pre_backward(index)

        for tensor in tensors:
            tensor.register_hook(on_output_grad)

    def _pre_backward(self, index: int) -> None:
        on_track = self.backward_trace.visit(index)
        params = self.fetchable(index)
        self._fetch(index, params, "backward", ahead=False)
        if on_track:
            self._prefetch(self.backward_trace, "backward prefetch")
        for p in params:
            finish_gather(p)

    # ------------------------------------------------------------ backward

    def begin_backward(self) -> None:
        """Open a backward round (idempotent within one): queue the
        end-of-backward callback. Call from inside autograd only."""
        if self._in_backward:
            return
        self._in_backward = True
        self._round += 1
        self.backward_trace.start_pass()
        torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)

    def after_grad(self, param: torch.Tensor) -> None:
        """A parameter's gradient was consumed: its full data can go."""
        if self._users.get(param.ds_id, 0) <= 0:
            self._release(param)

    def _end_backward(self) -> None:
        try:
            for hook in self._end_hooks:
                hook()
        finally:
            self._in_backward = False
            self._release_unused(reset_users=False)

    def finish_backward(self) -> None:
        """End a backward round whose callback did not run (idempotent)."""
        if self._in_backward:
            self._end_backward()

    def abandon_backward(self) -> None:
        """Forget a backward round that raised (its end hooks do not run) and
        release what it gathered."""
        if self._in_backward:
            self._in_backward = False
            self._release_unused(reset_users=False)

    # ------------------------------------------------------- gather/release

    def _fetch(self, index: int, params: tuple[torch.Tensor, ...], phase: str, *,
               ahead: bool) -> None:
        self._gather_batch([(index, params)], phase, ahead=ahead)
        if not ahead:
            for p in params:
                self.live.use(p.ds_id)

    def _gather_batch(self, items: Sequence[tuple[int, Sequence[torch.Tensor]]], phase: str,
                      *, ahead: bool) -> None:
        """Start gathering every released parameter of ``items`` (``(module
        index, params)``): one guard event for the whole batch (a prefetch
        spans several modules), then the gathers, all in flight together."""
        need = [(index, [p for p in params if p.ds_status is ZeroParamStatus.NOT_AVAILABLE])
                for index, params in items]
        need = [(index, todo) for index, todo in need if todo]
        if not need:
            return
        todo = [p for _, params in need for p in params]
        name = self.names[need[0][0]] + (f" and {len(need) - 1} more module(s)"
                                         if len(need) > 1 else "")
        self.guard.event(phase, name, [p.ds_id for p in todo], [p.ds_numel for p in todo])
        start_gathers(todo, self.strategy)
        for p in todo:
            if p.ds_id not in self.live:
                self.live.add(p.ds_id, p.ds_numel, ahead=ahead)

    def _release(self, param: torch.Tensor) -> None:
        take_gathered_edit(param)  # an in-place write in forward (max_norm) is kept
        release(param)
        if param.ds_status is ZeroParamStatus.NOT_AVAILABLE:
            self.live.remove(param.ds_id)

    def _release_unused(self, *, reset_users: bool, keep: AbstractSet[int] = frozenset()
                        ) -> None:
        """Release every gathered parameter no running forward uses (except
        ``keep``)."""
        if reset_users:
            self._users.clear()
        for pid in list(self.live.ids()):
            if self._users.get(pid, 0) <= 0 and pid not in keep:
                self._release(self.by_id[pid])

    def release_all(self) -> None:
        """Release every gathered parameter (between passes: DeepSpeed's
        ``empty_partition_cache``); the next pass gathers what it uses."""
        if self._root_depth or self._in_backward:
            raise DsrunError("empty_partition_cache() was called inside a forward or "
                             "backward pass of the ZeRO-3 model; call it between steps")
        self._release_unused(reset_users=True)

    def close(self) -> None:
        """Remove the hooks and release what is gathered."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        linear.mark(self._linear_marked, False)
        self._linear_marked = ()
        if self._linear_holder is not None:
            linear.uninstall(self._linear_holder)
            self._linear_holder = None
        for index in self.leaves:
            unmark_leaf_parameters(self.modules[index])
        for module in self.root.modules():
            if type(module.__dict__.get("_parameters")) is GatheringParameters:
                module._parameters = dict(module._parameters)
        if self in _READING:
            _READING.remove(self)
        self._running = []
        self._release_unused(reset_users=True)
