"""Pipeline parallelism: ``PipelineModule``, ``LayerSpec``, ``TiedLayerSpec``,
1F1B schedules as pure instruction streams, and the ``PipelineEngine``
(combined with data parallelism and ZeRO stage 1).

Pure parts (no processes): :mod:`.topology`, :mod:`.partition`,
:mod:`.schedule`, the message headers of :mod:`.p2p`, :mod:`.errors`.
Torch parts: :mod:`.layers`, :mod:`.module` (with DeepSpeed's accessors in
:mod:`.module_api`), :mod:`.grid`, :mod:`.tied`, :mod:`.engine`,
:mod:`.step`, :mod:`.losses`, :mod:`.metrics`. ``dsrun.pipe``
(``deepspeed.pipe``) is the public face.
"""

from __future__ import annotations

from dsrun.runtime.pipe.engine import PipelineEngine
from dsrun.runtime.pipe.layers import LayerSpec, TiedLayerSpec
from dsrun.runtime.pipe.module import PipelineModule
from dsrun.runtime.pipe.topology import (
    PipeDataParallelTopology,
    PipeModelDataParallelTopology,
    PipeTopology,
    ProcessTopology,
)

__all__ = ["LayerSpec", "PipeDataParallelTopology", "PipeModelDataParallelTopology",
           "PipeTopology", "PipelineEngine", "PipelineModule", "ProcessTopology",
           "TiedLayerSpec"]
