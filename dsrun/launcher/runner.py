"""DeepSpeed's ``deepspeed.launcher.runner`` module path: the names other
tools read from it (Accelerate's ``accelerate launch --use_deepspeed``
names the env file it writes with ``DEEPSPEED_ENVIRONMENT_NAME``). dsrun's
launcher is :mod:`dsrun.launcher.cli`; it reads these files too
(:mod:`dsrun.launcher.envpolicy`)."""

import os

from dsrun.launcher.envpolicy import DS_ENV_FILE_VAR, ENV_FILE_NAMES

#: the env file name DeepSpeed's launcher reads (``DS_ENV_FILE`` names another)
DEEPSPEED_ENVIRONMENT_NAME = os.getenv(DS_ENV_FILE_VAR, ENV_FILE_NAMES[0])
#: where it looks for it: the home directory, then the working directory
DEEPSPEED_ENVIRONMENT_PATHS = [os.path.expanduser("~"), "."]

__all__ = ["DEEPSPEED_ENVIRONMENT_NAME", "DEEPSPEED_ENVIRONMENT_PATHS"]
