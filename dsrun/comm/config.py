"""``deepspeed.comm.config``: the ``"comms_logger"`` config section.

``CommsLoggerConfig`` is dsrun's own section
(:class:`dsrun.runtime.config_sections.CommsLoggerConfig`: DeepSpeed's
keys and defaults, checked strictly); ``DeepSpeedCommsConfig(ds_config)``
reads it from a whole config dict as DeepSpeed's does, and
``dsrun.comm.configure(config)`` takes either, or the engine's resolved
config.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any, Optional

from dsrun.comm.constants import COMMS_LOGGER
from dsrun.runtime.config import _allow_unknown
from dsrun.runtime.config_monitors import CommsLoggerConfig
from dsrun.runtime.config_schema import Ctx, parse_section

__all__ = ["CommsLoggerConfig", "DeepSpeedCommsConfig"]


class DeepSpeedCommsConfig:
    """The ``comms_logger`` section of config dict ``ds_config``:
    ``comms_logger_enabled`` says whether the section is there (DeepSpeed's
    meaning: present, whatever its ``enabled``), ``comms_logger`` is the
    parsed section when it is (an unknown key is an error naming it, or a
    warning where the config or the environment allows unknown keys)."""

    def __init__(self, ds_config: Mapping[str, Any]) -> None:
        if not isinstance(ds_config, Mapping):
            raise TypeError(f"DeepSpeedCommsConfig takes the config as a dict, got "
                            f"{type(ds_config).__name__}")
        self.comms_logger_enabled = COMMS_LOGGER in ds_config
        self.comms_logger: Optional[CommsLoggerConfig] = None
        if self.comms_logger_enabled:
            ctx = Ctx("the config given to DeepSpeedCommsConfig",
                      allow_unknown=_allow_unknown(ds_config, os.environ))
            self.comms_logger = parse_section(CommsLoggerConfig, ds_config[COMMS_LOGGER],
                                              (COMMS_LOGGER,), ctx)
