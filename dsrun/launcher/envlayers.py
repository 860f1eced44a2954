"""A rank's environment as the node agent applies it (rankenv.py, agent side).

The start payload carries each rank's layers 3-5 as JSON (rankenv.RankEnv
``to_json``); :func:`apply_layers` puts all six layers together in order.
Plain dict operations on purpose: the node agent imports this and not the
planning modules, so that an agent starts quickly on every host.

Env-file values are expanded here, on the host the rank runs on, as
DeepSpeed's ``export KEY="VALUE"`` lines are expanded by the remote shell:
``$NAME`` and ``${NAME}`` (NAME: a letter or ``_``, then letters, digits and
``_``) become NAME's value in the environment the agent started with, with
the job's other variables (forwarded, ``--env_prefix``, ``--env``) set
first, as DeepSpeed exports its forwarded variables before the env-file
lines, then as changed by the env files' earlier lines (an unset NAME:
empty). So a local and a remote agent expand a line alike. Nothing else
is shell syntax here: ``$$``, ``$1``, ``${NAME:-default}``, backticks and a
lone ``$`` stay as written.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from dsrun.launcher.protocol import AGENT_BOOTSTRAP_VARS, PYTHONPATH_WAS

#: Variables the launcher or the agent sets for each rank of a job (rankenv's
#: layers 5-6, when that job asks for them). One inherited from elsewhere (a
#: dsrun started inside a rank of another job) would silently configure the
#: new job like the old one, so ranks never inherit these, and no prefix
#: forwards them (envpolicy.NEVER_FORWARDED); each job sets its own.
LAUNCHER_OWNED = frozenset({
    "DSRUN_JOB_ID", "DSRUN_RESTART_COUNT", "DSRUN_CONFIG", "DSRUN_DIST_BACKEND",
    "DSRUN_CPU_AFFINITY", "DSRUN_ACCELERATOR", "DSRUN_LOCAL_RANK_FILL",
    "DSRUN_AGENT_ID", "DSRUN_AGENT_PID", "DSRUN_ERROR_FILE", "DSRUN_STACK_FILE",
    PYTHONPATH_WAS,
})

_REFERENCE = re.compile(r"\$(?:\{([A-Za-z_][A-Za-z0-9_]*)\}|([A-Za-z_][A-Za-z0-9_]*))")


def expand_references(value: str, environ: Mapping[str, str]) -> str:
    """``value`` with each ``$NAME`` / ``${NAME}`` replaced by NAME's value in
    ``environ`` (empty when unset); any other ``$`` is kept."""
    return _REFERENCE.sub(lambda m: environ.get(m.group(1) or m.group(2), ""), value)


def expand_file_values(user: Mapping[str, str], files: Iterable[Sequence[Any]],
                       host: Mapping[str, str]) -> dict[str, str]:
    """``user`` with its env-file values expanded on this host.

    ``files``: (key, expand) of the job's env-file variables in the order
    the agent sets them (envpolicy.file_order); a key is expanded against
    ``host`` (the agent's own environment) with ``user``'s variables that
    are not from a file set over it (exported first, as DeepSpeed does),
    plus the env-file variables before it, like a shell running the lines
    one after another. ``expand`` is false for a value written in single
    quotes, which is literal.
    """
    values = dict(user)
    files = [tuple(pair) for pair in files]
    from_files = {key for key, _ in files}
    seen = {**host, **{k: v for k, v in values.items() if k not in from_files}}
    for key, expand in files:
        if key not in values:
            continue
        if expand:
            values[key] = expand_references(values[key], seen)
        seen[key] = values[key]
    return values


def apply_layers(layers: Mapping[str, Any], inherited: Mapping[str, str],
                 user: Mapping[str, str], agent: Mapping[str, str],
                 files: Iterable[Sequence[Any]] = ()) -> dict[str, str]:
    """The process environment of a rank: inherited (less the agent's own
    bootstrap variables and :data:`LAUNCHER_OWNED`), user (env-file values
    expanded against the inherited layer and the job's other variables: see
    :func:`expand_file_values`), defaults where unset, PATH prefix, dsrun's,
    the agent's."""
    out = {k: v for k, v in inherited.items()
           if k not in AGENT_BOOTSTRAP_VARS and k not in LAUNCHER_OWNED}
    out.update(expand_file_values(user, files, out))
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
