"""DeepSpeed's ``deepspeed.runtime.constants`` names that scripts pass to the
engine (``engine.deepspeed_io(dataset, route=ROUTE_EVAL)``); the config's
key names and defaults live with the config sections."""

from __future__ import annotations

__all__ = ["MEMORY_OPT_ALLREDUCE_SIZE", "ROUTE_ENCODE", "ROUTE_EVAL", "ROUTE_PREDICT",
           "ROUTE_TRAIN"]

#: ``engine.allreduce_gradients``'s default bucket (DeepSpeed's value)
MEMORY_OPT_ALLREDUCE_SIZE = 500_000_000
#: ``deepspeed_io`` routes: "train" shuffles, the others keep the order
ROUTE_TRAIN, ROUTE_EVAL, ROUTE_PREDICT, ROUTE_ENCODE = "train", "eval", "predict", "encode"
