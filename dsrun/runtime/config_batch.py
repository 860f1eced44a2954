"""The batch triple of a DeepSpeed config: ``train_batch_size =
train_micro_batch_size_per_gpu * gradient_accumulation_steps * dp_size``,
solved exactly from any two (never floored), every error naming the three
values and where the data-parallel size came from. Pure: no torch.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Optional

from dsrun.errors import DsrunConfigError
from dsrun.runtime.config_schema import DICT_SOURCE, Check, Ctx, check_value, is_auto

BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")


def resolve_batch(train: Optional[int], micro: Optional[int], accum: Optional[int],
                  dp_size: int, dp_source: str, *, source: str = DICT_SOURCE
                  ) -> tuple[int, int, int]:
    """Solve ``train = micro * accum * dp_size`` exactly; any two give the third.

    Only ``train``: accumulation 1 and micro = train / dp_size. Only
    ``micro``: accumulation 1. Neither train nor micro: an error. Every
    error names the three values and where ``dp_size`` came from.
    """
    if isinstance(dp_size, bool) or not isinstance(dp_size, int) or dp_size < 1:
        raise DsrunConfigError(f"data-parallel size must be a positive integer, got {dp_size!r} "
                               f"({dp_source})")
    for key, value in zip(BATCH_KEYS, (train, micro, accum)):
        if value is not None:
            check_value(value, Check("int", low=1), f'"{key}" in {source}')
    shown = ", ".join(f"{k}={'not set' if v is None else v}"
                      for k, v in zip(BATCH_KEYS, (train, micro, accum)))
    context = f"{shown} in {source} with data-parallel size {dp_size} ({dp_source})"
    if train is None and micro is None:
        raise DsrunConfigError(f"{context}: set train_batch_size or train_micro_batch_size_per_gpu"
                               " (an \"auto\" micro batch needs the dataloader's batch size)")
    if train is None:
        accum = accum or 1
        train = micro * accum * dp_size
    elif micro is None:
        accum = accum or 1
        micro = _exact(train, accum * dp_size, "gradient_accumulation_steps", dp_size, context)
    elif accum is None:
        accum = _exact(train, micro * dp_size, "train_micro_batch_size_per_gpu", dp_size, context)
    if train != micro * accum * dp_size:
        raise DsrunConfigError(f"{context}: train_batch_size must equal micro x accumulation x "
                               f"data-parallel size = {micro} x {accum} x {dp_size} = "
                               f"{micro * accum * dp_size}")
    return train, micro, accum


def _exact(train: int, divisor: int, other: str, dp_size: int, context: str) -> int:
    if train % divisor:
        raise DsrunConfigError(f"{context}: train_batch_size {train} is not divisible by {other} "
                               f"x data-parallel size = {divisor // dp_size} x {dp_size}")
    return train // divisor


def resolve_batch_keys(known: Mapping[str, Any], dp_size: int, dp_source: str,
                        micro_batch_hint: Optional[int], ctx: Ctx) -> tuple[int, int, int]:
    """The batch triple from the config's values; "auto" means "derive it"
    except for the micro batch, which takes the dataloader's batch size."""
    values: list[Optional[int]] = []
    for key in BATCH_KEYS:
        value = known.get(key)
        if is_auto(value):
            value = micro_batch_hint if key == "train_micro_batch_size_per_gpu" else None
            where = f"the dataloader batch size given for {ctx.where((key,))}"
        else:
            where = ctx.where((key,))
        values.append(None if value is None else check_value(value, Check("int", low=1), where))
    return resolve_batch(*values, dp_size, dp_source, source=ctx.source)
