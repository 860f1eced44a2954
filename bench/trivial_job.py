"""The trivial job every launcher runs in bench/launch_overhead.py.

Initialises the process group (itself, unless dsrun already did), one
barrier, exit. Works under dsrun, torchrun and plain python (one rank).
"""

import torch.distributed as dist

import dsrun

dsrun.init_distributed(backend="gloo")  # no-op when dsrun's runtime did it
dist.barrier()
dist.destroy_process_group()
