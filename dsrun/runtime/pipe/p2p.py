"""Messages between pipeline stages: a self-describing header, then tensors.

Every message (an activation, a gradient, a micro-batch's labels) is one
fixed-size ``int64`` **header** followed by its tensors, in order, on one
:class:`~dsrun.runtime.pipe.grid.Channel`. The header says what the message
is and what follows::

    [MAGIC, kind, batch, micro-batch, is_tuple, n,
     (dtype, requires_grad, ndim, *shape) x n, 0 ...]

so shapes and dtypes are exchanged with every micro-batch: activations may
change shape from one micro-batch to the next (sequence lengths, last
partial batches), and the receiver checks that the message is the one its
schedule expects - kind, batch number and micro-batch id - before using it
(labels are thereby always paired with their own micro-batch). Headers are
pure data (:func:`encode_header` / :func:`decode_header`), tested without
processes.

Sends are posted asynchronously and kept (with their tensors) in
:class:`PendingSends` until complete; receives block.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from dsrun import comm as collectives
from dsrun.errors import DsrunError
from dsrun.runtime.pipe.errors import PipeNotImplementedError
from dsrun.runtime.pipe.grid import Channel

MAGIC = 0x50495045  # "PIPE"
HEADER_LEN = 256
KINDS = ("train-activation", "eval-activation", "gradient", "labels")
DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64,
          torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64,
          torch.complex128)
_FIXED = 6


class PipeMessageError(DsrunError):
    """A message between stages is not what the receiving stage's schedule expects."""


@dataclass(frozen=True)
class TensorMeta:
    dtype: torch.dtype
    shape: tuple[int, ...]
    requires_grad: bool = False

    @classmethod
    def of(cls, tensor: torch.Tensor) -> TensorMeta:
        return cls(tensor.dtype, tuple(tensor.shape), tensor.requires_grad)

    def __str__(self) -> str:
        dtype = str(self.dtype).replace("torch.", "")
        return f"{dtype}{list(self.shape)}" + (" (requires grad)" if self.requires_grad else "")


@dataclass(frozen=True)
class Header:
    kind: str
    batch: int
    micro_batch: int
    metas: tuple[TensorMeta, ...]
    is_tuple: bool = False

    def describe(self) -> str:
        return f"the {self.kind} of micro-batch {self.micro_batch} of batch {self.batch}"


def encode_header(header: Header) -> list[int]:
    """The header's ``HEADER_LEN`` integers (module docstring)."""
    values = [MAGIC, KINDS.index(header.kind), header.batch, header.micro_batch,
              int(header.is_tuple), len(header.metas)]
    for meta in header.metas:
        if meta.dtype not in DTYPES:
            raise DsrunError(f"{header.describe()}: tensors of dtype {meta.dtype} cannot be "
                             f"sent between pipeline stages (supported: "
                             f"{', '.join(str(d).replace('torch.', '') for d in DTYPES)})")
        values += [DTYPES.index(meta.dtype), int(meta.requires_grad), len(meta.shape),
                   *meta.shape]
    if len(values) > HEADER_LEN:
        raise DsrunError(f"{header.describe()}: {len(header.metas)} tensors with "
                         f"{sum(len(m.shape) for m in header.metas)} dimensions in all are too "
                         f"many to describe in one pipeline message header ({HEADER_LEN} "
                         "integers); pass fewer tensors between stages")
    return values + [0] * (HEADER_LEN - len(values))


def decode_header(values: Sequence[int]) -> Header:
    if len(values) != HEADER_LEN or values[0] != MAGIC or not 0 <= values[1] < len(KINDS):
        raise PipeMessageError(f"received a malformed pipeline message header "
                               f"{list(values[:8])}...: a stage sent something else on a "
                               "pipeline channel")
    metas, i = [], _FIXED
    for _ in range(values[5]):
        dtype, requires_grad, ndim = values[i:i + 3]
        shape = tuple(int(v) for v in values[i + 3:i + 3 + ndim])
        metas.append(TensorMeta(DTYPES[dtype], shape, bool(requires_grad)))
        i += 3 + ndim
    return Header(KINDS[values[1]], int(values[2]), int(values[3]), tuple(metas),
                  bool(values[4]))


def check_header(got: Header, kind: str, batch: int, micro_batch: int, where: str) -> None:
    """``got`` is the message ``where`` expects, else one error naming both."""
    if (got.kind, got.batch, got.micro_batch) != (kind, batch, micro_batch):
        raise PipeMessageError(
            f"{where} expected the {kind} of micro-batch {micro_batch} of batch {batch} but "
            f"received {got.describe()}: the stages are out of step - every rank of a "
            "pipeline must make the same sequence of train_batch/eval_batch/forward calls"
            f"{_ran_out_hint(got, kind, batch, micro_batch)}")


def _ran_out_hint(got: Header, kind: str, batch: int, micro_batch: int) -> str:
    """The likely cause when a later batch's first micro-batch arrives in
    the middle of this one: the first stage's data iterator ran out there
    (its ``DataIteratorExhausted`` is a ``StopIteration``, which a training
    loop catches and goes on with the next batch, while this stage still
    waits inside the batch)."""
    if kind == "gradient" or micro_batch == 0 or got.micro_batch != 0 or got.batch <= batch:
        return ""
    return (f"; the first stage's data iterator probably ran out at micro-batch {micro_batch} "
            f"of batch {batch} (DataIteratorExhausted, a StopIteration its loop caught) and "
            "it went on to the next batch: give every train_batch()/eval_batch() a full "
            "batch of micro-batches (an iterator whose length is a multiple of "
            "gradient_accumulation_steps, or a RepeatingLoader)")


def check_metas(got: Sequence[TensorMeta], want: Sequence[TensorMeta], where: str) -> None:
    """Shapes and dtypes of a gradient against the activation it belongs to."""
    pairs = [(str(g.dtype), g.shape) for g in got], [(str(w.dtype), w.shape) for w in want]
    if pairs[0] != pairs[1]:
        raise PipeMessageError(f"{where}: received gradients {[str(g) for g in got]} for "
                               f"activations {[str(w) for w in want]}; shapes and dtypes must "
                               "match")


def flatten_payload(value: Any, where: str,
                    error: type[DsrunError] = PipeNotImplementedError
                    ) -> tuple[list[torch.Tensor], bool]:
    """``(tensors, is_tuple)`` of what a stage passes on: a tensor or a
    tuple/list of tensors; anything else raises ``error`` (by default also a
    ``NotImplementedError``, DeepSpeed's class when a stage output cannot
    be sent)."""
    if isinstance(value, torch.Tensor):
        return [value], False
    if isinstance(value, (tuple, list)) and all(isinstance(v, torch.Tensor) for v in value):
        return list(value), True
    kinds = type(value).__name__ if not isinstance(value, (tuple, list)) else \
        f"{type(value).__name__} of ({', '.join(type(v).__name__ for v in value)})"
    raise error(f"{where} is a {kinds}: what passes between pipeline stages must be a "
                "tensor or a tuple of tensors")


class PendingSends:
    """Posted sends and the tensors they read, kept until complete."""

    def __init__(self) -> None:
        self._items: list[tuple[Any, list[torch.Tensor]]] = []

    def add(self, works: list[Any], tensors: list[torch.Tensor]) -> None:
        self._items.append((works, tensors))
        self._items = [(w, t) for w, t in self._items if not all(x.is_completed() for x in w)]

    def wait_all(self) -> None:
        for works, _ in self._items:
            for work in works:
                work.wait()
        self._items = []

    def __len__(self) -> int:
        return len(self._items)


def send_message(channel: Channel, header: Header, tensors: Sequence[torch.Tensor],
                 pending: PendingSends, device: torch.device) -> None:
    """Post the header and the tensors (detached, contiguous) to ``channel.peer``."""
    values = encode_header(header)
    head = torch.tensor(values, dtype=torch.int64, device=device)
    payload = [head] + [t.detach().contiguous() for t in tensors if t.numel()]
    works = [collectives.isend(t, dst=channel.peer, group=channel.group) for t in payload]
    pending.add(works, payload)


def recv_message(channel: Channel, device: torch.device, kind: str, batch: int,
                 micro_batch: int, where: str) -> tuple[Header, list[torch.Tensor]]:
    """Receive one message, check it is the expected one, return its tensors."""
    head = torch.empty(HEADER_LEN, dtype=torch.int64, device=device)
    collectives.recv(head, src=channel.peer, group=channel.group)
    header = decode_header(head.tolist())
    check_header(header, kind, batch, micro_batch, where)
    tensors = []
    for meta in header.metas:
        tensor = torch.empty(meta.shape, dtype=meta.dtype, device=device)
        if tensor.numel():
            collectives.recv(tensor, src=channel.peer, group=channel.group)
        tensors.append(tensor)
    return header, tensors
