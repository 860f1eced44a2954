"""DeepSpeed's "torch-style backward": ``loss.backward()`` called by the script.

``engine.backward(loss)`` divides the loss by ``gradient_accumulation_steps``,
multiplies it by the fp16 loss scale, and around the backward arms and then
finishes the gradient reduction (the bucketed all-reduce at stage 0, the
reducers' flush at stages 1-3). A script may instead call
``loss.backward()`` itself - or ``engine.scale(loss).backward()`` under an
fp16 loss scale - as DeepSpeed 0.19.8 allows; the result must be the same.

Two sets of hooks do ``engine.backward``'s work for such a backward:

* a hook on each tensor the engine's forward returns notices the pass: the
  first time a training backward reaches an output it runs the engine's
  start-of-backward work and queues its end-of-backward work on the
  autograd engine (it runs when that pass has finished);
* a hook on each trainable parameter divides the gradient it receives by
  the accumulation steps while such a pass is open - at the parameters, not
  at the outputs, so that a gradient flowing through several outputs (a
  loss returned beside the logits it was computed from) is divided once.

Under a loss scale the pass must backward a loss ``engine.scale`` returned,
else it is refused before any parameter gradient exists.

Invariants:

* Inside ``engine.backward`` - any engine's - the hooks do nothing (the
  loss is already divided and scaled there).
* A pass that accumulates no parameter gradient - ``torch.autograd.grad``
  through the output, e.g. a gradient penalty - is not a training backward:
  nothing is divided or armed. A pass that reaches the parameters only
  through reentrant activation checkpoints (they accumulate in nested
  passes) is one.
* A loss that never reaches an engine output (a regulariser over the
  parameters backwarded on its own) is not seen: as in DeepSpeed, it is
  neither divided nor scaled.
* The parameter hooks hold only a small :class:`_Division` (no engine), so
  a model outliving its engine keeps neither the engine nor its optimizer
  state alive; ``remove`` (``engine.destroy()``) takes the hooks off, as
  does collecting an engine dropped without ``destroy()``.
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Optional

import torch
from torch.utils.hooks import RemovableHandle

from dsrun.errors import DsrunError
from dsrun.runtime.zero.fetch import output_tensors

#: autograd node classes of reentrant activation checkpoints (torch's and
#: DeepSpeed-style ``CheckpointFunction``), whose backward runs a nested pass
REENTRANT_NODES = ("CheckpointFunctionBackward",)


#: ``engine.backward`` calls running in this process, of every engine: a
#: backward one engine runs may pass through another's outputs (a GAN's
#: generator loss through its discriminator), which is then no script-started
#: pass for that other engine either
_engine_backwards = [0]


class UnscaledBackwardError(DsrunError, RuntimeError):
    """``loss.backward()`` under an fp16 loss scale without ``engine.scale``
    (a RuntimeError, as DeepSpeed raises)."""


def _task_id() -> int:
    return int(torch._C._current_graph_task_id())


def _will_run(node: Any) -> bool:
    try:
        return bool(torch._C._will_engine_execute_node(node))
    except RuntimeError:  # not part of the running pass's graph
        return False


def accumulates_into(params: Iterable[torch.nn.Parameter]) -> bool:
    """Called from a backward hook: does the running pass accumulate a
    gradient into one of ``params`` (``backward``), or none (``autograd.grad``)?"""
    for param in params:
        if not param.requires_grad:
            continue
        node = torch.autograd.graph._get_grad_fn_or_grad_acc(param)
        if node is not None and _will_run(node):
            return True
    return False


def _runs_checkpoint(node: Any) -> bool:
    """Will the running pass run reentrant checkpoint ``node``'s backward?

    Asked of the node's inputs, not of the node: the pass's root (an engine
    output that a reentrant checkpoint returned, the loss itself) is never
    in torch's set of nodes the pass will execute, and a node that
    ``torch.autograd.grad`` captures a gradient at - its tensor is one of
    the inputs - counts as executed although its backward never runs. A
    checkpoint's backward runs exactly when the pass goes on to its inputs
    (one whose backward ran in a ``torch.autograd.grad`` pass refuses it)."""
    return any(_will_run(child) for child, _ in node.next_functions if child is not None)


def reaches_reentrant_checkpoint(root: Any) -> bool:
    """Does the running pass run a reentrant checkpoint at or below ``root``
    (its nested pass accumulates the parameters inside)?"""
    seen, todo = set(), [root]
    while todo:
        node = todo.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        if type(node).__name__ in REENTRANT_NODES and _runs_checkpoint(node):
            return True
        todo.extend(next_node for next_node, _ in node.next_functions)
    return False


class _Division:
    """The parameter hook: divides a gradient while a script-started pass is
    open. A separate object, not a method of :class:`DirectBackward`, so the
    hook each parameter holds keeps no engine alive (and costs what a bound
    method does: no weak reference to follow per gradient)."""

    __slots__ = ("divisor",)

    def __init__(self) -> None:
        self.divisor = 0  # while a script-started training pass runs: its divisor; else 0

    def __call__(self, grad: torch.Tensor) -> torch.Tensor:
        if self.divisor > 1 and not _engine_backwards[0]:
            return grad / self.divisor
        return grad


def _remove_handles(handles: list[RemovableHandle]) -> None:
    for handle in handles:
        handle.remove()
    handles.clear()


class DirectBackward:
    """The engine's side of backward passes the script starts itself.

    ``start`` runs once per such pass and returns its end-of-backward work;
    ``accumulation`` and ``scaled`` are read at each pass (the script may
    change the accumulation steps; the fp16 scaler may be disabled)."""

    def __init__(self, params: Callable[[], Iterable[torch.nn.Parameter]],
                 start: Callable[[], Callable[[], None]],
                 accumulation: Callable[[], int], scaled: Callable[[], bool]) -> None:
        self._params = params
        self._start = start
        self._accumulation = accumulation
        self._scaled = scaled
        self._task: Optional[int] = None  # the graph task the output hooks last saw
        self._division = _Division()
        self._scaled_task: Optional[int] = None  # the pass that backwarded engine.scale's tensor
        self._hooked: set[int] = set()
        self._handles: list[RemovableHandle] = []
        # an engine dropped without destroy(): its hooks go when it is collected
        self._unhook = weakref.finalize(self, _remove_handles, self._handles)
        self._unhook.atexit = False

    def hook_params(self, params: Optional[list[torch.nn.Parameter]] = None) -> None:
        """Hook every trainable parameter (of ``params``, else of the
        module) not hooked yet. Called when a script-started training pass
        begins, before any parameter's gradient exists (a hook added then
        applies in that pass): the first hooks them all, a later one a
        parameter unfrozen or added since. Not at each forward, where it
        would walk the module tree on every micro-step even when every
        backward is ``engine.backward``'s."""
        if not self._unhook.alive:  # removed: a forward after destroy() hooks nothing
            return
        for param in self._params() if params is None else params:
            if param.requires_grad and id(param) not in self._hooked:
                self._hooked.add(id(param))
                self._handles.append(param.register_hook(self._division))

    def remove(self) -> None:
        """Take the parameter hooks off (``engine.destroy()``); again is harmless."""
        self._unhook()
        self._hooked.clear()

    def watch(self, output: Any) -> None:
        """Hook the engine forward's output tensors that will get gradients."""
        if not torch.is_grad_enabled():
            return
        for tensor in output_tensors(output):
            if tensor.requires_grad:
                tensor.register_hook(functools.partial(self._on_output_grad, tensor.grad_fn))

    def scaled(self, loss: torch.Tensor) -> None:
        """``engine.scale`` returned ``loss``: a backward through it is scaled
        (its hook, which runs before any output's, marks the pass)."""
        loss.register_hook(self._on_scaled_grad)

    def _on_scaled_grad(self, grad: torch.Tensor) -> torch.Tensor:
        self._scaled_task = _task_id()
        return grad

    def _on_output_grad(self, root: Any, grad: torch.Tensor) -> torch.Tensor:
        if _engine_backwards[0]:
            return grad
        task = _task_id()
        if task != self._task:
            self._task = task
            params = list(self._params())
            if accumulates_into(params) or reaches_reentrant_checkpoint(root):
                self.hook_params(params)
                self._begin()
        return grad

    def _begin(self) -> None:
        """First output a script-started training backward reaches: check the
        loss scale, arm the reduction, open the division, queue the finish."""
        if self._scaled() and self._scaled_task != self._task:
            raise UnscaledBackwardError(
                "loss.backward() under an fp16 loss scale: the loss was not scaled. Use "
                "engine.backward(loss), or engine.scale(loss).backward() as in DeepSpeed")
        finish = self._start()
        self._division.divisor = max(1, self._accumulation())

        def done() -> None:
            self._division.divisor = 0
            finish()

        torch.autograd.Variable._execution_engine.queue_callback(done)

    @contextlib.contextmanager
    def engine_backward_running(self) -> Iterator[None]:
        _engine_backwards[0] += 1
        self._division.divisor = 0  # a script-started pass that failed left it open
        try:
            yield
        finally:
            _engine_backwards[0] -= 1
