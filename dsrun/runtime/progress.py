"""What the training runtime tells the user: the config at start, then a
progress line every ``steps_per_print`` optimizer steps (rank 0), followed
by a memory line when the config asks for ``memory_breakdown``.

Everything goes through ``logging`` (logger ``dsrun.runtime``). Like
DeepSpeed's logger, which users see without configuring anything,
:func:`ensure_visible` gives that logger a stdout handler at INFO that writes
only while the application has configured no logging of its own (the root
logger has no handlers); records always propagate, so an application that
sets up logging, before or after, gets them through its own handlers, once.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Mapping
from typing import Any, Optional

LOGGER_NAME = "dsrun.runtime"
log = logging.getLogger(LOGGER_NAME)
_HANDLER_MARK = "_dsrun_default_handler"


class _NoApplicationLogging(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not logging.getLogger().handlers


def ensure_visible() -> None:
    """Attach the default stdout handler to ``dsrun.runtime`` once (module doc)."""
    if any(getattr(h, _HANDLER_MARK, False) for h in log.handlers):
        return
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter("[dsrun] %(message)s"))
    handler.setLevel(logging.INFO)
    handler.addFilter(_NoApplicationLogging())
    setattr(handler, _HANDLER_MARK, True)
    log.addHandler(handler)
    if log.level == logging.NOTSET:
        log.setLevel(logging.INFO)


def every(step: int, n: Optional[int]) -> bool:
    """Whether ``step`` is a multiple of ``n``: a print step of
    ``steps_per_print=n`` (``None``: never)."""
    return n is not None and step % n == 0


class Progress:
    """Accumulates losses and samples between progress lines (rank 0 prints)."""

    def __init__(self, steps_per_print: Optional[int], samples_per_step: int, enabled: bool,
                 memory: bool = False) -> None:
        self.steps_per_print = steps_per_print
        self.samples_per_step = samples_per_step
        self.enabled = enabled
        self.memory = memory
        self._loss_sum: Any = 0.0
        self._loss_count = 0
        self._named_sums: dict[str, Any] = {}  # a pipeline's additional losses
        self._since = time.perf_counter()
        self._steps = 0

    def record_loss(self, loss: Any, named: Optional[Mapping[str, Any]] = None) -> None:
        """Add one micro-batch's (unscaled) loss, and a pipeline batch's
        additional losses by name (``agg_additional_losses``), printed after
        ``loss=`` as DeepSpeed's pipeline prints them; a tensor stays a tensor
        until printed."""
        if not hasattr(loss, "detach"):  # (before anything else reads it)
            from dsrun.errors import DsrunError

            raise DsrunError(f"engine.backward() takes the loss tensor, got "
                             f"{type(loss).__name__} {loss!r}: pass the loss itself "
                             f"(not loss.item()), which carries the graph to run backward on")
        if self.enabled:
            self._loss_sum = self._loss_sum + loss.detach().float()
            self._loss_count += 1
            for name, value in (named or {}).items():
                self._named_sums[name] = (self._named_sums.get(name, 0.0)
                                          + value.detach().float())

    def step(self, global_steps: int, skipped: int, lrs: list[float],
             extra: Optional[str] = None) -> None:
        """Called after every optimizer step (applied or skipped)."""
        self._steps += 1
        if not self.enabled or not every(global_steps, self.steps_per_print):
            return
        elapsed = max(time.perf_counter() - self._since, 1e-9)
        rate = self._steps * self.samples_per_step / elapsed
        parts = [f"step={global_steps}", f"skipped={skipped}"]
        if self._loss_count:
            parts.append(f"loss={float(self._loss_sum) / self._loss_count:.4f}")
            parts += [f"{name}={float(total) / self._loss_count:.4f}"
                      for name, total in self._named_sums.items()]
        parts.append("lr=[" + ", ".join(f"{lr:.6g}" for lr in lrs) + "]")
        if extra:
            parts.append(extra)
        parts.append(f"samples/s={rate:.1f}")
        log.info(", ".join(parts))
        if self.memory:
            log.info("%s", memory_line())
        self._loss_sum, self._loss_count, self._steps = 0.0, 0, 0
        self._named_sums = {}
        self._since = time.perf_counter()


def _mib(n: float) -> str:
    return f"{n / 2**20:,.0f} MiB"


def memory_line() -> str:
    """This process's memory now and at its peak (``memory_breakdown``):
    CUDA allocated / reserved (where CUDA is in use), host resident set
    (both through :mod:`dsrun.accelerator`), and the machine's memory in use."""
    import psutil
    import torch

    from dsrun.accelerator import CpuAccelerator, CudaAccelerator

    parts = []
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        cuda = CudaAccelerator()
        parts.append(f"CUDA allocated {_mib(cuda.memory_allocated())} (peak "
                     f"{_mib(cuda.max_memory_allocated())}), reserved "
                     f"{_mib(cuda.memory_reserved())} (peak "
                     f"{_mib(cuda.max_memory_reserved())})")
    host = CpuAccelerator()
    parts.append(f"host RSS {_mib(host.memory_allocated())} "
                 f"(peak {_mib(host.max_memory_allocated())})")
    parts.append(f"machine memory in use {psutil.virtual_memory().percent:.0f}%")
    return "memory: " + "; ".join(parts)
