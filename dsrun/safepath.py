"""The working directory that ``python -m`` puts first on ``sys.path``,
dropped by dsrun's own entry points (the node agent, the rank bootstrap)
before their other imports: a ``random.py``, ``json.py`` or ``queue.py``
in the user's working directory must not stand in for the stdlib modules
that dsrun and torch import. This module imports nothing but os and sys.
(``import dsrun`` itself ran before, as the -m parent package.)"""

from __future__ import annotations

import os
import sys


def drop_cwd_entry() -> str | None:
    """Remove the working-directory entry ``python -m`` put at
    ``sys.path[0]`` (call it from the ``-m`` module only) and return it;
    None when there is none to drop: under ``-P``/PYTHONSAFEPATH, or the
    directory was removed (then Python could not put it there either)."""
    try:
        cwd = os.getcwd()
    except OSError:
        return None
    if sys.path and sys.path[0] == cwd and not getattr(sys.flags, "safe_path", False):
        return sys.path.pop(0)
    return None
