"""A rank's environment as the node agent applies it (rankenv.py, agent side).

The start payload carries each rank's layers 3-5 as JSON (rankenv.RankEnv
``to_json``); :func:`apply_layers` puts all six layers together in order.
Plain dict operations on purpose: the node agent imports this and not the
planning modules, so that an agent starts quickly on every host.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from typing import Any

from dsrun.launcher.protocol import AGENT_BOOTSTRAP_VARS


def apply_layers(layers: Mapping[str, Any], inherited: Mapping[str, str],
                 user: Mapping[str, str], agent: Mapping[str, str]) -> dict[str, str]:
    """The process environment of a rank: inherited (less the agent's own
    bootstrap variables), user, defaults where unset, PATH prefix, dsrun's,
    the agent's."""
    out = {k: v for k, v in inherited.items() if k not in AGENT_BOOTSTRAP_VARS}
    out.update(user)
    for key, value in _pairs(layers.get("defaults", {})):
        out.setdefault(key, value)
    prepend = list(layers.get("path_prepend", ()))
    if prepend:
        out["PATH"] = os.pathsep.join([*prepend, out.get("PATH", os.defpath)])
    out.update(_pairs(layers.get("dsrun", {})))
    out.update(agent)
    return out


def _pairs(obj: Mapping[str, str] | Iterable[tuple[str, str]]) -> Iterable[tuple[str, str]]:
    return obj.items() if isinstance(obj, Mapping) else obj
