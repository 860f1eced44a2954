"""Changing the batch size of a running engine: DeepSpeed's
``engine.set_train_batch_size`` and ``engine.set_train_micro_batch_size``
(batch-size warm-up and curriculum schedules call them between steps).

``set_train_batch_size(B)`` keeps the micro-batch size and changes the
number of micro-batches per optimizer step (``B / (micro x data-parallel
size)``, which must be a whole number); ``set_train_micro_batch_size(m)``
keeps the accumulation steps and changes the global batch to ``m x
accumulation x data-parallel size``. Either is allowed only at an
accumulation boundary (between optimizer steps), so no step mixes two
batch sizes.

Why this is safe with ZeRO: the stages never plan for a count of
micro-batches. Stage 2 and 3 reduce every micro-batch's gradients into
the partitions and stage 1 either does the same (built without
accumulation) or reduces the accumulated gradient at the boundary; the
engine divides each micro-batch's loss by the accumulation steps in force.
So a new count only changes when the boundary comes and that division.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Optional

from dsrun.errors import DsrunError

log = logging.getLogger("dsrun.runtime.engine")

__all__ = ["new_batch", "resize_batch"]


def _positive_int(value: Any, what: str) -> int:
    """``value`` as an int >= 1; a whole float (8.0) counts, as in the config."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{what} must be an integer >= 1, got {value!r}")
    return value


def new_batch(current: tuple[int, int, int], dp: int, *, train: Optional[int] = None,
              micro: Optional[int] = None) -> tuple[int, int, int]:
    """``(train, micro, accumulation)`` after setting ``train`` (micro kept)
    or ``micro`` (accumulation kept), from ``current`` = the same triple."""
    _, old_micro, old_accum = current
    if (train is None) == (micro is None):
        raise ValueError("give exactly one of train= and micro=")
    if train is not None:
        train = _positive_int(train, "train_batch_size")
        per_step = old_micro * dp
        if train % per_step:
            raise ValueError(
                f"train_batch_size {train} is not a multiple of micro-batch size {old_micro} x "
                f"data-parallel size {dp} = {per_step}: the micro-batch size is kept, so the "
                f"batch must be a whole number of micro-batches on every rank")
        return train, old_micro, train // per_step
    micro = _positive_int(micro, "micro_batch_size")
    return micro * old_accum * dp, micro, old_accum


def resize_batch(engine: Any, *, train: Optional[int] = None,
                 micro: Optional[int] = None) -> None:
    """Apply :func:`new_batch` to ``engine`` (its config, progress line,
    monitor and, for a pipeline, its micro-batches per ``train_batch``)."""
    config = engine.config
    accum = config.gradient_accumulation_steps
    done = engine.micro_in_round()
    if done:
        raise DsrunError(
            f"the batch size can change only between optimizer steps: {done} of this step's "
            f"{accum} micro-batches have run; call it after the engine.step() that ends the "
            f"accumulation")
    current = (config.train_batch_size, config.train_micro_batch_size_per_gpu, accum)
    train_size, micro_size, accumulation = new_batch(current, engine.dp_world_size,
                                                     train=train, micro=micro)
    if (train_size, micro_size, accumulation) == current:
        return  # Megatron sets the same size before every iteration: nothing to do or say
    engine.config = dataclasses.replace(config, train_batch_size=train_size,
                                        train_micro_batch_size_per_gpu=micro_size,
                                        gradient_accumulation_steps=accumulation)
    engine.start_accumulation_round()
    engine.progress.samples_per_step = train_size
    engine.monitor.set_batch(engine.config)
    if micro_size != current[1] and getattr(engine, "training_dataloader", None) is not None:
        log.warning("train_micro_batch_size_per_gpu is now %d, but the dataloader "
                    "dsrun.initialize() built still yields batches of %d: build a new one",
                    micro_size, current[1])
    if engine.global_rank == 0:
        log.info("batch size: train %d = micro %d x accumulation %d x data-parallel %d "
                 "(was %d = %d x %d x %d)", train_size, micro_size, accumulation,
                 engine.dp_world_size, current[0], current[1], current[2],
                 engine.dp_world_size)
