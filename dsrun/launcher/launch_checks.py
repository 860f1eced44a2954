"""What the launcher checks of the script and the log directory before any
process starts, and what it asks every host's probe to check of them.

Split from launch.py (the launch path), which calls these first: a missing
script or an unusable ``--log_dir`` is a usage error (exit 2) with nothing
started.
"""

from __future__ import annotations

import os
import shutil

from dsrun.errors import DsrunUsageError
from dsrun.launcher.netinfo import script_problem
from dsrun.launcher.plan import LaunchPlan
from dsrun.launcher.spec import LaunchSpec


def check_script(spec: LaunchSpec) -> None:
    """The script must be runnable as ``python SCRIPT`` (a file, or a directory
    or zip file with a ``__main__.py``) or, with --no_python, as the shell
    would run it (a bare name is looked up on PATH only)."""
    if spec.module:
        return
    if spec.no_python and os.sep not in spec.script:
        if shutil.which(spec.script):
            return
        if os.path.exists(spec.script):
            raise DsrunUsageError(f"--no_python: {spec.script!r} is not on PATH (a bare name "
                                  f"is looked up there, as the shell does); did you mean "
                                  f"./{spec.script}?")
        raise DsrunUsageError(f"--no_python: {spec.script!r} is not on PATH")
    if not os.path.exists(spec.script):
        raise DsrunUsageError(f"script {spec.script!r} does not exist")
    if not spec.no_python and os.path.isdir(spec.script):
        problem = script_problem(spec.script)  # the remote preflight's test, here
        if problem:
            raise DsrunUsageError(f"script {spec.script!r} {problem} (python runs a "
                                  f"directory's __main__.py)")
        return
    if not os.path.isfile(spec.script):
        raise DsrunUsageError(f"script {spec.script!r} is not a file")
    if spec.no_python and not os.access(spec.script, os.X_OK):
        raise DsrunUsageError(f"--no_python: {spec.script!r} is not executable")


def probed_script(spec: LaunchSpec) -> str | None:
    """The path every host's probe checks (as check_script does here):
    not for -m (finding a module needs the rank's own PYTHONPATH and may
    import its packages), nor for a --no_python program found on PATH."""
    if spec.module or (spec.no_python and os.sep not in spec.script):
        return None
    return spec.script


def check_log_dir(path: str | None) -> None:
    if path is None:
        return
    if os.path.exists(path) and not os.path.isdir(path):
        raise DsrunUsageError(f"--log_dir {path!r} is a file, not a directory")
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as exc:
        raise DsrunUsageError(f"--log_dir {path!r}: {exc.strerror}") from None
    if not os.access(path, os.W_OK):
        raise DsrunUsageError(f"--log_dir {path!r} is not writable")


def log_files(plan: LaunchPlan) -> list[list[str]] | None:
    """Per host of ``plan``, its ranks' --log_dir files, for the probe: each
    host checks it can open them before any rank starts anywhere (the
    launcher's own check of the directory says nothing of another host's)."""
    if not plan.log_dir:
        return None
    return [[os.path.join(plan.log_dir, f"rank_{r.rank}.log") for r in node.ranks]
            for node in plan.nodes]
