"""``engine.save_16bit_model``: the module's weights in the training's 16-bit
dtype, as one ``torch.save`` file (DeepSpeed's ``pytorch_model.bin``).

The parameters are written in float16 under fp16, bfloat16 under bf16
(dsrun's bf16 keeps fp32 parameters and computes under autocast), and fp32
otherwise; the buffers in the dtype the module holds them in (an fp32
buffer stays fp32 - ``data_types`` decides it at initialize()), as
DeepSpeed saves the module's own tensors. At ZeRO stage 3 the
parameters are partitioned: they are gathered one at a time, so the extra
memory is one parameter on every rank plus the output on rank 0, and only
when ``stage3_gather_16bit_weights_on_model_save`` is set - otherwise
nothing is written and False is returned, as DeepSpeed does. Rank 0 writes
the file atomically (temporary name, fsync, rename); every rank returns
after it is there. :func:`zero3_consolidated_16bit_state_dict` returns the
same state dict instead (DeepSpeed's private API that Hugging Face uses).
"""

from __future__ import annotations

import io
import logging
import os
from collections import OrderedDict
from typing import Any, Optional

import torch

from dsrun.runtime.checkpoint.coord import raise_failures
from dsrun.runtime.checkpoint.engine_io import checkpointer, wait
from dsrun.runtime.checkpoint.storage import atomic_write
from dsrun.runtime.zero.init import GatheredParameters
from dsrun.runtime.zero.partitioned import ZeroParamStatus, is_zero_param

log = logging.getLogger("dsrun.runtime.checkpoint")


def _dtype(engine: Any) -> torch.dtype:
    if engine.config.fp16.enabled:
        return torch.float16
    if engine.config.bf16.enabled:
        return torch.bfloat16
    return torch.float32


def _host(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A host copy of ``tensor``: a floating parameter in ``dtype``, a buffer
    as it is."""
    value = tensor.detach()
    if value.is_floating_point() and isinstance(tensor, torch.nn.Parameter):
        value = value.to(dtype)
    return value.to("cpu", copy=True)


def state_dict16(engine: Any, exclude_frozen: bool, keep: bool) -> OrderedDict:
    """The module's state dict, parameters in the 16-bit dtype (only ``keep``
    ranks collect it; at stage 3 every rank takes part in the gathers)."""
    dtype = _dtype(engine)
    module = engine.module
    out: OrderedDict[str, torch.Tensor] = OrderedDict()
    done: dict[int, torch.Tensor] = {}
    for name, tensor in module.state_dict(keep_vars=True).items():
        if exclude_frozen and isinstance(tensor, torch.nn.Parameter) and not tensor.requires_grad:
            continue
        if id(tensor) not in done:
            if is_zero_param(tensor):
                # one whole already (kept whole; every one at world size 1) is
                # read as it is: a context over it would copy it on its device
                released = tensor.ds_status is not ZeroParamStatus.AVAILABLE
                with GatheredParameters([tensor] if released else []):
                    value = _host(tensor, dtype) if keep else None
            else:
                value = _host(tensor, dtype) if keep else None
            done[id(tensor)] = value  # type: ignore[assignment]
        if keep:
            out[name] = done[id(tensor)]
    return out


def zero3_consolidated_16bit_state_dict(engine: Any, exclude_frozen_parameters: bool = False
                                        ) -> Optional[OrderedDict]:
    """DeepSpeed's ``engine._zero3_consolidated_16bit_state_dict`` (what
    Hugging Face Trainer and Accelerate call to save a ZeRO-3 model): the
    full state dict (parameters in the 16-bit dtype) on global rank 0, None
    on the other ranks; tied parameters share one tensor. Every rank must
    call it (the parameters are gathered one at a time). Only at stage 3
    (ValueError otherwise, as DeepSpeed); unlike :func:`save_16bit_model`
    it does not need ``stage3_gather_16bit_weights_on_model_save``, as in
    DeepSpeed."""
    if engine.zero_stage != 3:
        raise ValueError("_zero3_consolidated_16bit_state_dict() requires ZeRO stage 3 (this "
                         f"engine runs stage {engine.zero_stage}): use "
                         "engine.module.state_dict()")
    wait(engine)
    keep = engine.global_rank == 0
    state = state_dict16(engine, exclude_frozen_parameters, keep=keep)
    return state if keep else None


def save_16bit_model(engine: Any, save_dir: str, save_filename: str = "pytorch_model.bin",
                     exclude_frozen_parameters: bool = False) -> bool:
    """``engine.save_16bit_model`` (module docstring)."""
    wait(engine)
    if engine.zero_stage == 3 and \
            not engine.config.zero_optimization.gather_16bit_weights_on_model_save:
        log.warning("did not save the model %s: at ZeRO stage 3 it needs "
                    "\"stage3_gather_16bit_weights_on_model_save\": true in zero_optimization "
                    "(or use dsrun checkpoint to-fp32 on a checkpoint)",
                    os.path.join(save_dir, save_filename))
        return False
    coord = checkpointer(engine).coord
    path = os.path.join(os.path.abspath(save_dir), save_filename)
    coord.agree("engine.save_16bit_model()", {"path": path})
    state = state_dict16(engine, exclude_frozen_parameters, keep=coord.rank == 0)
    status = None
    if coord.rank == 0:
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            buffer = io.BytesIO()
            torch.save(state, buffer)
            atomic_write(path, buffer.getvalue())
        except Exception as exc:  # noqa: BLE001 - reported on every rank
            status = f"{type(exc).__name__}: {exc}"
    raise_failures(coord.exchange(status), f"saving the 16-bit model to {path}")
    return True
