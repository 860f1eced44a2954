"""DeepSpeed's ``deepspeed.checkpoint`` module path, for the helpers other
tools import from it (:mod:`.utils`). DeepSpeed's universal-checkpoint
conversion lives here in DeepSpeed; dsrun's checkpoints need none (any
world size and ZeRO stage load directly: :mod:`dsrun.runtime.checkpoint`).
Not to be confused with :mod:`dsrun.checkpointing` (activation
checkpointing)."""

from dsrun.checkpoint.constants import *  # noqa: F403 - DeepSpeed's key names, as it exports them
from dsrun.checkpoint.constants import __all__  # noqa: F401
