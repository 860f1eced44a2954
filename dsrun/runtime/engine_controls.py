"""What a running engine's owner may change: DeepSpeed's
``set_train_batch_size`` / ``set_train_micro_batch_size``
(:mod:`dsrun.runtime.batch_size`) and ``compile`` (:mod:`dsrun.runtime.compile`),
as a mixin of :class:`~dsrun.runtime.engine.DsrunEngine`."""

from __future__ import annotations

from typing import Any, Optional

from dsrun.runtime.batch_size import resize_batch
from dsrun.runtime.compile import compile_module

__all__ = ["EngineControls"]


class EngineControls:
    """Mixed into the engine: reads and sets its ``_compiled``, ``config``
    and counters."""

    module: Any
    _compiled: Any
    _step_profiler: Any

    def _forward_module(self) -> Any:
        """The compiled module after engine.compile(), except on the flops
        profiler's step (its counts need every operator dispatched)."""
        if self._compiled is None or (self._step_profiler is not None
                                      and self._step_profiler.active()):
            return self.module
        return self._compiled

    def compile(self, backend: Any = None,  # type: ignore[override]
                compile_kwargs: Optional[dict[str, Any]] = None, schedule: Any = None) -> None:
        """DeepSpeed's: ``torch.compile`` the module for the engine's forward
        (:mod:`dsrun.runtime.compile`; stages 0-2)."""
        compiled = compile_module(self, backend, compile_kwargs, schedule)
        if compiled is not None:
            # not a submodule of the engine: its state dict and parameters
            # stay those of engine.module alone
            self.__dict__["_compiled"] = compiled

    @property
    def is_compiled(self) -> bool:
        return self._compiled is not None

    def set_train_batch_size(self, train_batch_size: int) -> None:
        """DeepSpeed's: a new global batch, as more or fewer micro-batches
        per step (the micro-batch size is kept); between steps only."""
        resize_batch(self, train=train_batch_size)

    def set_train_micro_batch_size(self, micro_batch_size: int) -> None:
        """DeepSpeed's: a new micro-batch size, the accumulation steps kept."""
        resize_batch(self, micro=micro_batch_size)
