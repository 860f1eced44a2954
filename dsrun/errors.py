"""One exception hierarchy for everything dsrun reports to a user.

Every error the CLI can show derives from :class:`DsrunError`; its message
names the offending value and where it came from. ``exit_code`` is what the
CLI exits with when the error reaches it (2 for bad input, as click does).
"""

from __future__ import annotations


class DsrunError(Exception):
    """Base of all errors dsrun raises on purpose."""

    exit_code = 1


class DsrunUsageError(DsrunError):
    """Bad command-line input: a flag value, a missing script, a busy port."""

    exit_code = 2


class HostfileError(DsrunUsageError):
    """A hostfile that cannot be read or is malformed (names file, line, column)."""


class SelectionError(DsrunUsageError):
    """--include/--exclude/--num_nodes/--num_gpus that do not fit the resources."""


class DsrunConfigError(DsrunError, ValueError):
    """A training config (DeepSpeed-style JSON/dict) that is invalid."""


class LaunchError(DsrunError):
    """A job could not be started (agent failed to start, host unreachable)."""


class CheckpointError(DsrunError):
    """A checkpoint that cannot be saved or loaded: it names the file, tag,
    tensor or rank at fault, and the engine is left as it was."""


#: What a checkpoint error says when a peer went away during a save or load
#: (the checkpoint coordinator writes it; the launcher's report reads it to
#: blame the rank that died rather than this one).
RANK_LOST = "a rank died or stopped"
