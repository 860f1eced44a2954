"""DeepSpeed's ``deepspeed.runtime.activation_checkpointing`` package path:
its ``checkpointing`` module is :mod:`dsrun.checkpointing` itself (the
``deepspeed`` import alias maps
``deepspeed.runtime.activation_checkpointing.checkpointing`` to it)."""

from __future__ import annotations

from dsrun import checkpointing

__all__ = ["checkpointing"]
