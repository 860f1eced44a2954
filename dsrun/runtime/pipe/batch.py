"""What one batch of a pipeline engine holds while its schedule runs.

:class:`BatchState` keeps, per micro-batch id, exactly what is still
needed: the stage's input (until its gradient is sent back), its output
(until the next stage's gradient for it has been applied), the labels (on
the last stage, until the loss is computed) and the received gradients (until
backward). Every entry is dropped once used, so with 1F1B a stage holds the
tensors of at most ``stages - stage`` micro-batches.

Also here: reading a micro-batch from the data iterator, checked
(:func:`split_micro_batch`), and moving nested tensors to a device.
As DeepSpeed reads a micro-batch: item 0 is the inputs and item 1 the
labels (further items are ignored, with one warning), and a list of inputs
or labels - what torch's ``default_collate`` makes of tuples - becomes a
tuple, so layers that test ``isinstance(x, tuple)`` and the activation
checkpoints (which take a tuple's tensors as separate arguments) see one.
An iterator that runs out raises :class:`DataIteratorExhausted`, a
``StopIteration`` as in DeepSpeed.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from dsrun.errors import DsrunError
from dsrun.runtime.pipe.errors import PipeTypeError
from dsrun.runtime.pipe.p2p import TensorMeta

log = logging.getLogger("dsrun.runtime")
_warned_extra = False


class DataIteratorExhausted(DsrunError, StopIteration):
    """The data iterator ran out inside a batch: a ``StopIteration`` (what
    DeepSpeed's engine raises there), with the reason."""


@dataclass
class BatchState:
    kind: str  # "train" or "eval"
    batch: int  # the engine's batch counter: same on every stage
    micro_batches: int
    source: Optional[Iterator[Any]] = None  # first stage: the data iterator
    inputs: dict[int, Any] = field(default_factory=dict)
    outputs: dict[int, Any] = field(default_factory=dict)
    labels: dict[int, Any] = field(default_factory=dict)
    grads: dict[int, list[torch.Tensor]] = field(default_factory=dict)
    sent: dict[int, list[TensorMeta]] = field(default_factory=dict)
    wanted: dict[int, list[bool]] = field(default_factory=dict)  # grads the sender wants back
    losses: dict[int, torch.Tensor] = field(default_factory=dict)
    loss_values: list[torch.Tensor] = field(default_factory=list)
    # train, last stage: get_additional_losses() summed over the micro-batches
    additional: Optional[OrderedDict[str, torch.Tensor]] = None
    results: list[Any] = field(default_factory=list)  # eval: the last output, last stage
    keep_outputs: bool = False  # last stage: keep the last micro-batch's output in results
    compute_loss: bool = True  # last stage: apply loss_fn (else the output is the value)
    compute_s: float = 0.0  # time in forward and backward passes
    pipeline_s: float = 0.0  # from the batch start to the last pass

    @property
    def activation_kind(self) -> str:
        return "train-activation" if self.kind == "train" else "eval-activation"


def to_device(value: Any, device: torch.device) -> Any:
    """``value`` with every tensor in its lists, tuples and dicts moved to ``device``."""
    from dsrun.runtime.utils import map_nested

    return map_nested(value, lambda v: v.to(device, non_blocking=True)
                      if isinstance(v, torch.Tensor) else v)


def next_micro_batch(source: Optional[Iterator[Any]], micro_batch: int, micro_batches: int
                     ) -> Any:
    if source is None:
        raise PipeTypeError("the first pipeline stage needs data: pass data_iter= to "
                            "train_batch()/eval_batch(), call engine.set_dataiterator(), or "
                            "pass training_data= to dsrun.initialize()")
    try:
        return next(source)
    except StopIteration:
        raise DataIteratorExhausted(f"the data iterator ran out at micro-batch {micro_batch} of "
                         f"{micro_batches}: one train_batch()/eval_batch() reads "
                         f"{micro_batches} micro-batches (gradient_accumulation_steps); "
                         "use a longer or repeating iterator") from None


def split_micro_batch(batch: Any, micro_batch: int) -> tuple[Any, Any]:
    """``(inputs, labels)`` of one micro-batch from the data iterator
    (module docstring)."""
    global _warned_extra
    if isinstance(batch, (tuple, list)) and len(batch) >= 2:
        if len(batch) > 2 and not _warned_extra:
            _warned_extra = True
            log.warning("micro-batch %d from the data iterator has %d items: item 0 is the "
                        "inputs and item 1 the labels, the other %d are ignored (as "
                        "DeepSpeed does)", micro_batch, len(batch), len(batch) - 2)
        inputs, labels = batch[0], batch[1]
        return (tuple(inputs) if isinstance(inputs, list) else inputs,
                tuple(labels) if isinstance(labels, list) else labels)
    what = f"a {type(batch).__name__}" + (f" of {len(batch)} items"
                                          if isinstance(batch, (tuple, list)) else "")
    raise DsrunError(f"micro-batch {micro_batch} from the data iterator is {what}: a "
                     "pipeline micro-batch is a pair (inputs, labels), inputs a tensor or a "
                     "tuple of tensors (use engine.set_batch_fn() to convert other formats)")
