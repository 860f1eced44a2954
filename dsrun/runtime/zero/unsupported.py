"""``optimizer.add_param_group`` on a ZeRO 1-3 optimizer: refused by name.

A ZeRO optimizer lays its flat partitions out at ``initialize()`` over the
parameters it was given; a group cannot join them later. DeepSpeed 0.19.8's
ZeRO optimizers have no ``add_param_group`` (torch's bare AttributeError).
dsrun keeps ``hasattr(optimizer, "add_param_group")`` False, as there (code
that probes for it takes its other path), but a call gets an error that
says why and what to do: :class:`AddParamGroupError` is an AttributeError
too, so code that catches DeepSpeed's still catches it.
"""

from __future__ import annotations

from typing import Any

from dsrun.errors import DsrunError


class AddParamGroupError(DsrunError, AttributeError):
    """``add_param_group`` called on a ZeRO 1-3 optimizer."""


class RefusesAddParamGroup:
    """Mixin of the ZeRO optimizers: ``add_param_group`` refused (module docstring)."""

    stage: int

    @property
    def add_param_group(self) -> Any:
        raise AddParamGroupError(
            f"optimizer.add_param_group is not supported at ZeRO stage {self.stage}: the ZeRO "
            "optimizer's partitions are laid out at initialize() over the parameters it was "
            "given (DeepSpeed's ZeRO optimizers have no add_param_group either). Put every "
            "parameter group in the optimizer before initialize() - a parameter frozen then "
            "is left out at stages 1-3, so add it unfrozen and freeze it with a zero "
            "learning rate instead - or call initialize() again with the new groups, or use "
            "ZeRO stage 0, whose optimizer is the torch one and takes new groups")
