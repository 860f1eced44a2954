"""The communication logger's part of ``deepspeed.comm``: ``comms_logger``
(the logger itself), :func:`configure`, :func:`log_summary`,
:func:`reset_log` and the counts (re-exported by :mod:`dsrun.comm.comm`,
where DeepSpeed has them). The logger is :mod:`dsrun.runtime.commlog`."""

from __future__ import annotations

import datetime
from collections.abc import Mapping
from typing import Any, Optional

import torch.distributed as dist

from dsrun.runtime.commlog import LOGGER, straggler_analysis, straggler_ms, summary_table

__all__ = ["comms_logger", "configure", "get_comm_operation_count", "get_logged_comm_ops",
           "has_comm_data", "log_summary", "reset_log"]

#: DeepSpeed's module-level logger object (``deepspeed.comm.comms_logger``):
#: ``.enabled``, ``.comms_dict`` (its records in DeepSpeed's layout), ...
comms_logger = LOGGER


def _grouped() -> bool:
    return dist.is_available() and dist.is_initialized()


def configure(deepspeed_config: Any = None, enabled: Optional[bool] = None,
              prof_all: Optional[bool] = None, prof_ops: Optional[list[str]] = None,
              verbose: Optional[bool] = None, debug: Optional[bool] = None) -> None:
    """Set up the communication logger: from a config's ``comms_logger``
    section (``deepspeed_config``: see :func:`comms_section`), then the
    keywords given."""
    section = comms_section(deepspeed_config)
    if section is not None:  # as DeepSpeed: a config's "enabled": false switches it off
        LOGGER.configure(enabled=section.enabled)
    if section is not None and section.enabled:
        LOGGER.configure(prof_all=section.prof_all, prof_ops=section.prof_ops,
                         verbose=section.verbose, debug=section.debug)
    LOGGER.configure(enabled=enabled, prof_all=prof_all, prof_ops=prof_ops, verbose=verbose,
                     debug=debug)


def comms_section(deepspeed_config: Any) -> Any:
    """The ``comms_logger`` section of ``deepspeed_config``, None when it
    has none: a resolved :class:`~dsrun.runtime.config.DsrunConfig`, a
    :class:`~dsrun.comm.config.DeepSpeedCommsConfig` (or anything with a
    ``comms_logger`` attribute), ``deepspeed.runtime.config.DeepSpeedConfig``
    (its ``dsrun_config``), an object laid out as DeepSpeed's (its
    ``comms_config``), or a config dict (read by ``DeepSpeedCommsConfig``)."""
    if deepspeed_config is None:
        return None
    for owner in (deepspeed_config, getattr(deepspeed_config, "dsrun_config", None),
                  getattr(deepspeed_config, "comms_config", None)):
        if owner is not None and hasattr(owner, "comms_logger"):
            return owner.comms_logger  # None: a DeepSpeedCommsConfig without the section
    if isinstance(deepspeed_config, Mapping):
        from dsrun.comm.config import DeepSpeedCommsConfig  # (it imports the config layer)

        return DeepSpeedCommsConfig(deepspeed_config).comms_logger
    raise TypeError(f"deepspeed.comm.configure(deepspeed_config=...) takes a DeepSpeedConfig, a "
                    f"resolved dsrun config or a config dict, got "
                    f"{type(deepspeed_config).__name__}")


def log_summary(show_straggler: bool = False, return_dict: bool = False
                ) -> Optional[dict[str, Any]]:
    """Print (rank 0) and/or return this rank's logged operations:
    ``{"summary": {log name: {size: {...}}}, "straggler_analysis": ...,
    "metadata": {...}}``, the analysis in DeepSpeed's layout
    (:func:`~dsrun.runtime.commlog.straggler_analysis`; the printed table's
    straggler column is the spread of the ranks' total latencies).
    Collective (barriers; with ``show_straggler`` an all-gather of every
    rank's latencies): every rank must call it."""
    from dsrun.comm.comm import get_rank, get_world_size  # (it imports this module)

    grouped = _grouped()
    if grouped:  # its own communication is not logged
        dist.barrier()
    rank, world = get_rank(), get_world_size()
    summary = LOGGER.summary()
    spread = analysis = None
    if show_straggler:
        everyone: list[Any] = [LOGGER.latencies()]
        if grouped:
            everyone = [None] * world
            dist.all_gather_object(everyone, LOGGER.latencies())
        spread = straggler_ms([{key: sum(lats) for key, lats in ranks.items()}
                               for ranks in everyone])
        analysis = straggler_analysis(everyone, rank if grouped else 0)
    if rank == 0:
        print(summary_table(summary, spread), flush=True)
    if grouped:
        dist.barrier()
    if not return_dict:
        return None
    return {"summary": summary, "straggler_analysis": analysis,
            "metadata": {"world_size": world, "rank": rank,
                         "timestamp": datetime.datetime.now().isoformat(timespec="seconds")}}


def reset_log() -> None:
    """Forget every logged operation (e.g. per epoch)."""
    LOGGER.reset()


def has_comm_data() -> bool:
    return LOGGER.has_data()


def get_comm_operation_count() -> int:
    """Profiled operations logged so far (all names and sizes)."""
    return LOGGER.get_total_operations()


def get_logged_comm_ops() -> list[str]:
    return sorted(LOGGER.records)
