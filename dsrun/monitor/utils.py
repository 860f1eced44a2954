"""DeepSpeed's ``deepspeed.monitor.utils``: is a monitor backend's package
installed? Each check imports the package, and where it is missing prints
what to install (DeepSpeed's lines) and raises the ``ImportError``, as
DeepSpeed's do. (dsrun's monitors check their packages themselves, on
every rank, before anything starts: :func:`dsrun.runtime.monitor.writers.check_package`.)
"""

from __future__ import annotations

import importlib
import re

__all__ = ["check_comet_availability", "check_tb_availability", "check_wandb_availability"]

#: the oldest comet_ml DeepSpeed 0.19.8's Comet monitor takes
COMET_MIN_VERSION = (3, 41, 0)


def _import_or_say(package: str, hint: str) -> object:
    try:
        return importlib.import_module(package)
    except ImportError:
        print(hint)
        raise


def check_tb_availability() -> None:
    """``tensorboard`` is importable (torch.utils.tensorboard needs it)."""
    _import_or_say("tensorboard",
                   "If you want to use tensorboard logging, please `pip install tensorboard`")


def check_wandb_availability() -> None:
    """``wandb`` is importable."""
    _import_or_say("wandb", "If you want to use wandb logging, please `pip install wandb` and "
                            "follow the instructions at https://docs.wandb.ai/quickstart")


def _release(version: str) -> tuple[int, ...]:
    """``"3.41.2rc1"`` -> ``(3, 41, 2)``: the leading numeric release."""
    match = re.match(r"\d+(?:\.\d+)*", version.strip())
    return tuple(int(part) for part in match.group(0).split(".")) if match else ()


def check_comet_availability() -> None:
    """``comet_ml`` >= 3.41.0 is importable."""
    hint = 'If you want to use comet logging, please `pip install "comet_ml>=3.41.0"`'
    comet_ml = _import_or_say("comet_ml", hint)
    version = str(getattr(comet_ml, "__version__", ""))
    if _release(version) < COMET_MIN_VERSION:
        print(hint)
        raise ImportError(f"`comet_ml` must have at least version 3.41.0, found {version!r}")
