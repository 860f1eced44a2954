"""DeepSpeed's ``deepspeed.ops.op_builder.builder.OpBuilder``, for the
class-level queries scripts make at start-up (Megatron-DeepSpeed asks
``OpBuilder.is_rocm_pytorch()``). dsrun builds no C++/CUDA extensions:
constructing a builder, or loading one, is an error that says so.
"""

from __future__ import annotations

from typing import Any

from dsrun.errors import DsrunError


class OpBuilder:
    """The queries answer for the installed torch; building is refused."""

    def __init__(self, name: str = "", *args: Any, **kwargs: Any) -> None:
        raise DsrunError(f"OpBuilder({name!r}): dsrun builds no C++/CUDA extensions; its "
                         "optimizers are torch code (dsrun.ops: Adam, Adagrad, Lamb, Lion)")

    @staticmethod
    def is_rocm_pytorch() -> bool:
        """Whether the installed torch is a ROCm build."""
        import torch

        return getattr(torch.version, "hip", None) is not None
