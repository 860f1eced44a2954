"""``dsrun.comm``: what DeepSpeed scripts use as ``deepspeed.comm``.

``import dsrun as deepspeed`` then ``deepspeed.comm.get_rank()``, or
``from deepspeed import comm as dist`` (see :mod:`dsrun._alias`). A
package along DeepSpeed's lines, each module importable by its DeepSpeed
path (``deepspeed.comm.comm`` and the rest):

- :mod:`dsrun.comm.comm` - the collectives, point-to-point operations, rank
  and group queries and the communication logger's API, all re-exported
  here;
- :mod:`dsrun.comm.utils` - ``get_*_from_launcher`` and the helpers that
  read a collective's arguments;
- :mod:`dsrun.comm.reduce_op` - DeepSpeed's ``ReduceOp``;
- :mod:`dsrun.comm.constants`, :mod:`dsrun.comm.config` - backend names,
  the ``comms_logger`` section's keys, defaults and parser;
- :mod:`dsrun.comm.backend`, :mod:`dsrun.comm.pg_utils` - DeepSpeed's
  ``Backend`` base class and ``is_parallel(group)``.
"""

from dsrun.comm.comm import *  # noqa: F403 - (it has utils' names too, as DeepSpeed's)
from dsrun.comm.comm import __all__  # noqa: F401
