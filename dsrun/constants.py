"""DeepSpeed's ``deepspeed.constants``: the names scripts import from it.

``from deepspeed.constants import TORCH_DISTRIBUTED_DEFAULT_PORT`` (a
launcher helper's default port), ``CROSS_RANK, CROSS_SIZE`` (the names of
the variables holding the node's index and the node count, which dsrun's
launcher sets as DeepSpeed's does), and ``default_pg_timeout``, with
DeepSpeed 0.19.8's values:

* ``TORCH_DISTRIBUTED_DEFAULT_PORT`` is 29500 (``dsrun``'s top-level
  constant, the same object). It is DeepSpeed's and torch's default master
  port; dsrun's launcher picks a free port instead unless ``--master_port``
  is given.
* ``default_pg_timeout`` is ``DEEPSPEED_TIMEOUT`` (whole minutes, read when
  this module is first imported; an invalid value is the
  :class:`~dsrun.errors.DsrunError` of
  :func:`dsrun.runtime.dist.timeout_from_env`), else 10 minutes, as
  DeepSpeed's. dsrun's own groups follow the same variable, but without it
  they get torch's default (30 minutes for gloo, 10 for NCCL): a script
  that passes this value explicitly gets 10 minutes on gloo too.
"""

from __future__ import annotations

import datetime
import os

from dsrun import TORCH_DISTRIBUTED_DEFAULT_PORT
from dsrun.runtime.dist import timeout_from_env

__all__ = ["CROSS_RANK", "CROSS_SIZE", "INFERENCE_GENERIC_MODE", "INFERENCE_SPECIALIZED_MODE",
           "LOCAL_RANK", "TORCH_DISTRIBUTED_DEFAULT_PORT", "default_pg_timeout"]

#: DeepSpeed's default when ``DEEPSPEED_TIMEOUT`` is not set
DEFAULT_TIMEOUT_MINUTES = 10
default_pg_timeout: datetime.timedelta = (
    timeout_from_env(os.environ) or datetime.timedelta(minutes=DEFAULT_TIMEOUT_MINUTES))

# DeepSpeed's inference modes (dsrun has no inference engine; the names only)
INFERENCE_GENERIC_MODE = "generic"
INFERENCE_SPECIALIZED_MODE = "specialized"

# names of environment variables
CROSS_RANK = "CROSS_RANK"
CROSS_SIZE = "CROSS_SIZE"
LOCAL_RANK = "LOCAL_RANK"
