"""The PYTHONPATH a node agent starts with: the one its ranks get, so that
the agent imports the same dsrun as they do (a checkout on a shared path),
as DeepSpeed's pdsh runner exports it for its per-node launcher.

- A value passed as it is (the launcher's, forwarded; ``--env``; an env-file
  line without ``$``) goes to every agent, local or remote.
- A value an env file expands on each host (``$HOME/lib``): a local agent
  gets it expanded here, exactly as its ranks will get it (the same
  environment); a remote agent gets it expanded by its login shell, which
  expands just the ``$NAME`` / ``${NAME}`` references that the agent would
  (envlayers.py) and nothing else; a reference to one of the job's other
  variables (forwarded, ``--env``) is its value, written in, as the agent
  expands it. A value that refers to another env-file variable is not
  given to remote agents (their shell does not know it).
- The agent also gets :data:`PYTHONPATH_WAS` (its login environment's
  PYTHONPATH, ``:`` first, empty when unset), so its ranks' environment is
  built from the login environment as before (agent_os.login_environ):
  ``$PYTHONPATH`` in an env file means the host's value, not the agent's.

PYTHONPATH is the one environment value ever put on a command line (the
remote one); ``--dry-run`` shows it as ``<value not shown>``, as it shows
the ranks' variables.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from dsrun.launcher.envlayers import _REFERENCE, expand_file_values
from dsrun.launcher.envpolicy import JobEnv
from dsrun.launcher.protocol import PYTHONPATH_WAS

#: How --dry-run shows the value.
NOT_SHOWN = "<value not shown>"


def local_agent_env(user_env: JobEnv, environ: Mapping[str, str]) -> dict[str, str] | None:
    """The environment of a local agent (``environ`` with the ranks'
    PYTHONPATH), or None: the ranks get no PYTHONPATH of the job's."""
    values = user_env.as_dict()
    if "PYTHONPATH" not in values:
        return None
    if "PYTHONPATH" in user_env.expanded_keys():
        values = expand_file_values(values, user_env.files, environ)
    was = environ.get("PYTHONPATH")
    return {**environ, PYTHONPATH_WAS: "" if was is None else f":{was}",
            "PYTHONPATH": values["PYTHONPATH"]}


def remote_assignments(user_env: JobEnv, shown: bool = False) -> str | None:
    """The shell words that give a remote agent the ranks' PYTHONPATH (POSIX
    shell syntax), or None. ``shown``: for --dry-run, the value not shown."""
    values = user_env.as_dict()
    value = values.get("PYTHONPATH")
    if not value:
        return None
    was = f'{PYTHONPATH_WAS}="${{PYTHONPATH+:$PYTHONPATH}}"'
    if shown:
        return f"{was} PYTHONPATH={NOT_SHOWN}"
    if "PYTHONPATH" not in user_env.expanded_keys():
        return f"{was} PYTHONPATH={_single_quoted(value)}"
    files = {key for key, _ in user_env.files}
    if any((m.group(1) or m.group(2)) in files - {"PYTHONPATH"}
           for m in _REFERENCE.finditer(value)):
        return None  # another env-file variable: only the agent knows its value
    known = {k: v for k, v in values.items() if k not in files}
    return f"{was} PYTHONPATH={_references_only(value, known)}"


def _single_quoted(value: str) -> str:
    return "'" + value.replace("'", "'\"'\"'") + "'"


def _references_only(value: str, known: Mapping[str, str]) -> str:
    """``value`` in double quotes in which the shell expands only ``$NAME``
    and ``${NAME}`` (unset: empty), as envlayers.expand_references does;
    every other ``$``, backquote, backslash and quote is literal. A NAME in
    ``known`` (the job's variables set before the file lines) is its value
    there, literal, as the agent sees it."""
    out, pos = [], 0
    for m in _REFERENCE.finditer(value):
        out.append(_escaped(value[pos:m.start()]))
        name = m.group(1) or m.group(2)
        out.append(_escaped(known[name]) if name in known else "${" + name + "}")
        pos = m.end()
    out.append(_escaped(value[pos:]))
    return '"' + "".join(out) + '"'


def _escaped(text: str) -> str:
    return re.sub(r'([$`"\\])', r"\\\1", text)
