"""``dsrun.pipe``: what DeepSpeed scripts use as ``deepspeed.pipe``.

``import dsrun as deepspeed`` then ``from deepspeed.pipe import
PipelineModule, LayerSpec`` (see :mod:`dsrun._alias`) or
``deepspeed.pipe.PipelineModule``. Importing this module imports torch
(``import dsrun`` alone does not). The implementation lives in
:mod:`dsrun.runtime.pipe`.
"""

from __future__ import annotations

from dsrun.runtime.pipe import (
    LayerSpec,
    PipeDataParallelTopology,
    PipelineEngine,
    PipelineModule,
    PipeModelDataParallelTopology,
    PipeTopology,
    ProcessTopology,
    TiedLayerSpec,
)

__all__ = ["LayerSpec", "PipeDataParallelTopology", "PipeModelDataParallelTopology",
           "PipeTopology", "PipelineEngine", "PipelineModule", "ProcessTopology",
           "TiedLayerSpec"]
