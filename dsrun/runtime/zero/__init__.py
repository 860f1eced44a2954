"""ZeRO (Rajbhandari et al. 2020) for dsrun: partitioning maths, collectives,
the stage 1/2 sharded optimizer, and model-state memory accounting.

* :mod:`.partition` - pure: flat padded per-rank partitions of param groups.
* :mod:`.comm` - reduce-scatter / all-gather done the fastest way per backend.
* :mod:`.reducer` - stage 2's bucketed gradient reduction during backward.
* :mod:`.flat` - parameters and gradients as views of flat buffers, fp32
  masters aliasing them.
* :mod:`.masters` - what every stage does on its fp32 masters (unscale,
  overflow, norm, clip, the inner optimizer's implementation and pieces).
* :mod:`.offload` - placement, and the copies across the bus (side-stream
  landing of gradients in host memory, the fence for pinned sources).
* :mod:`.groups` - client param groups and the stages' settings.
* :mod:`.sharded` - :class:`ZeroOptimizer`, the engine's entry point (its
  module docstring states the call order).
* :mod:`.memory` - the paper's per-rank formulas and actual byte counts.
* :mod:`.stage3` - :class:`ZeroStage3`, stage 3 (parameters partitioned),
  with :mod:`.stage3_plan` (pure bookkeeping), :mod:`.stage3_setup`
  (membership, partitioning, flat shards), :mod:`.partitioned`
  (partitioned parameters), :mod:`.fetch` (gather/release hooks),
  :mod:`.reduce3` (gradient reduction), :mod:`.linear` (memory-efficient
  linear), :mod:`.divergence` (hang diagnosis) and :mod:`.init`
  (``zero.Init``, ``GatheredParameters``).
* :mod:`.state_io` - the optimizers' side of the checkpoint interface
  (:mod:`dsrun.runtime.checkpoint.fragments`): per-name fragments of the
  masters and optimizer state, out for a save and back in for a load.
"""

from dsrun.runtime.zero.comm import (
    CommStrategy,
    all_gather_flat,
    reduce_scatter_mean,
    strategy_for,
)
from dsrun.runtime.zero.divergence import GuardSettings
from dsrun.runtime.zero.init import (
    GatheredParameters,
    Init,
    register_external_parameter,
    unregister_external_parameter,
)
from dsrun.runtime.zero.memory import (
    StateBytes,
    model_state_bytes,
    paper_model_state_bytes,
    zero_model_state_bytes,
)
from dsrun.runtime.zero.partition import GroupLayout, Piece, partition_group, partition_groups
from dsrun.runtime.zero.partitioned import ZeroParameter, ZeroParamStatus
from dsrun.runtime.zero.sharded import ZeroOptimizer, ZeroSettings
from dsrun.runtime.zero.stage3 import Stage3Settings, ZeroStage3

__all__ = [
    "CommStrategy", "GroupLayout", "Piece", "StateBytes", "ZeroOptimizer", "ZeroSettings",
    "all_gather_flat", "model_state_bytes", "paper_model_state_bytes", "partition_group",
    "partition_groups", "reduce_scatter_mean", "strategy_for", "zero_model_state_bytes",
    "GatheredParameters", "GuardSettings", "Init", "Stage3Settings", "ZeroParamStatus",
    "ZeroParameter", "ZeroStage3", "register_external_parameter",
    "unregister_external_parameter",
]


def __getattr__(name: str) -> object:
    # DeepSpeed's deepspeed.runtime.zero.partition_parameters (Init,
    # GatheredParameters, ZeroParamStatus, ...) is dsrun.zero: reachable by
    # attribute after a bare "import deepspeed", as DeepSpeed imports it eagerly
    if name == "partition_parameters":
        import dsrun.zero

        return dsrun.zero
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
