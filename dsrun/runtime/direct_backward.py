"""DeepSpeed's "torch-style backward": ``loss.backward()`` called by the script.

``engine.backward(loss)`` divides the loss by ``gradient_accumulation_steps``,
multiplies it by the fp16 loss scale, and around the backward arms and then
finishes the gradient reduction (the bucketed all-reduce at stage 0, the
reducers' flush at stages 1-3). A script may instead call
``loss.backward()`` itself - or ``engine.scale(loss).backward()`` under an
fp16 loss scale - as DeepSpeed 0.19.8 allows; the result must be the same.

A hook on each tensor the engine's forward returns does ``engine.backward``'s
work for such a backward: the first time a backward pass reaches an output it
runs the engine's start-of-backward work and queues its end-of-backward work
on the autograd engine (it runs when that pass has finished), and every
output's gradient is divided by the accumulation steps before it flows into
the model. Under a loss scale the loss must come from ``engine.scale`` (one
scale per backward), else the backward is refused before any parameter
gradient exists.

Invariants:

* Inside ``engine.backward`` the hooks do nothing (the loss is already
  divided and scaled there).
* A pass that accumulates no parameter gradient - ``torch.autograd.grad``
  through the output, e.g. a gradient penalty - is not a training backward:
  its gradients are not divided and nothing is armed.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Optional

import torch

from dsrun.errors import DsrunError
from dsrun.runtime.zero.fetch import output_tensors


class UnscaledBackwardError(DsrunError, RuntimeError):
    """``loss.backward()`` under an fp16 loss scale without ``engine.scale``
    (a RuntimeError, as DeepSpeed raises)."""


def _task_id() -> int:
    return int(torch._C._current_graph_task_id())


def accumulates_into(params: Iterable[torch.nn.Parameter]) -> bool:
    """Called from a backward hook: does the running pass accumulate a
    gradient into one of ``params`` (``backward``), or none (``autograd.grad``)?"""
    for param in params:
        if not param.requires_grad:
            continue
        node = torch.autograd.graph._get_grad_fn_or_grad_acc(param)
        if node is not None and torch._C._will_engine_execute_node(node):
            return True
    return False


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
        self._inside = 0  # engine.backward calls running
        self._task: Optional[int] = None  # the graph task the hooks last saw
        self._divisor = 1  # for that task's outputs: 1 = leave the gradient alone
        self.scale_pending = False  # engine.scale(loss) called since the last backward

    def watch(self, output: Any) -> None:
        """Hook the engine forward's output tensors that will get gradients."""
        if not torch.is_grad_enabled():
            return
        for tensor in output_tensors(output):
            if tensor.requires_grad:
                tensor.register_hook(self._on_grad)

    def _on_grad(self, grad: torch.Tensor) -> torch.Tensor:
        if self._inside:
            return grad
        task = _task_id()
        if task != self._task:
            self._task = task
            self._divisor = self._begin() if accumulates_into(self._params()) else 1
        return grad / self._divisor if self._divisor > 1 else grad

    def _begin(self) -> int:
        """First output of a script-started training backward: check the loss
        scale, arm the reduction, queue its finish; -> the gradient divisor."""
        if self._scaled() and not self.scale_pending:
            raise UnscaledBackwardError(
                "loss.backward() under an fp16 loss scale: the loss was not scaled. Use "
                "engine.backward(loss), or engine.scale(loss).backward() as in DeepSpeed")
        self.scale_pending = False
        finish = self._start()
        torch.autograd.Variable._execution_engine.queue_callback(finish)
        return max(1, self._accumulation())

    @contextlib.contextmanager
    def engine_backward_running(self) -> Iterator[None]:
        self._inside += 1
        try:
            yield
        finally:
            self._inside -= 1
