"""``deepspeed.comm.constants``: DeepSpeed's backend names and the keys of
its ``"comms_logger"`` config section, with their defaults (the same
values; also in ``deepspeed.comm`` itself, as there)."""

from __future__ import annotations

NCCL_BACKEND = "nccl"
CCL_BACKEND = "ccl"
MPI_BACKEND = "mpi"
GLOO_BACKEND = "gloo"
SCCL_BACKEND = "sccl"
HCCL_BACKEND = "hccl"

DEFAULT_AML_MASTER_PORT = "54965"
DEFAULT_AML_NCCL_SOCKET_IFNAME = "^docker0,lo"

COMMS_LOGGER_FORMAT = '''
The Comms Logger can be specified as:
"comms_logger": {
  "enabled": true,
  "verbose": false,
  "prof_all": true,
  "debug": false,
  "prof_ops": ["all_reduce", "custom_all_reduce_name"]
}
'''
COMMS_LOGGER = "comms_logger"
COMMS_LOGGER_ENABLED = "enabled"
COMMS_LOGGER_ENABLED_DEFAULT = False
COMMS_LOGGER_VERBOSE = "verbose"
COMMS_LOGGER_VERBOSE_DEFAULT = False
COMMS_LOGGER_PROF_ALL = "prof_all"
COMMS_LOGGER_PROF_ALL_DEFAULT = True
COMMS_LOGGER_DEBUG = "debug"
COMMS_LOGGER_DEBUG_DEFAULT = False
COMMS_LOGGER_PROF_OPS = "prof_ops"
COMMS_LOGGER_PROF_OPS_DEFAULT: list[str] = []

__all__ = [name for name in dir() if name.isupper()]
