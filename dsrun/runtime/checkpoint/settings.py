"""What a save or load is told to do: the ``checkpoint`` config section and
the crash-test pause point, read once into frozen objects.

``"checkpoint": {"async": true}`` makes saves asynchronous; ``"timeout"``
is how long, in seconds, a rank waits for the others to enter a save or
load before it names the ones missing; ``"fsync": false`` skips fsync
(what ``torch.save`` and DeepSpeed do: safe against a crashed process, not
against an OS crash or power cut) (DeepSpeed's keys ``tag_validation``,
``load_universal``, ``use_node_local_storage``, ``parallel_write`` and
``writer`` are accepted: dsrun's format is always universal and always
checks tags, see the README).

:class:`PausePoint` exists for crash-safety tests only: with
``DSRUN_CHECKPOINT_TEST_PAUSE=RANK:PHASE`` the save on rank ``RANK`` stops
at ``PHASE`` (``stage``: an asynchronous save before it copies the state
in the background; ``write``: half of its data written; ``commit``: rank 0, the
manifest written and the directory not yet renamed; ``latest``: renamed,
``latest`` not yet written), creates the file named by
``DSRUN_CHECKPOINT_TEST_PAUSE_MARK`` and waits until the file named by
``DSRUN_CHECKPOINT_TEST_RELEASE`` exists (forever when unset) - so a test
can SIGKILL a rank in the middle of a save, or train while it waits.
``RANK:PHASE:TAG`` pauses only the save of that tag. The file named by the
mark gets ``RANK PHASE PID``.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Optional

from dsrun.errors import DsrunConfigError

PHASES = ("stage", "write", "commit", "latest")
DEFAULT_TIMEOUT_S = 600.0
PAUSE_ENV = "DSRUN_CHECKPOINT_TEST_PAUSE"
MARK_ENV = "DSRUN_CHECKPOINT_TEST_PAUSE_MARK"
RELEASE_ENV = "DSRUN_CHECKPOINT_TEST_RELEASE"


@dataclass(frozen=True)
class PausePoint:
    """Stop rank ``rank`` at ``phase`` of a save (module docstring)."""

    rank: int
    phase: str
    mark: Optional[str] = None
    release: Optional[str] = None
    tag: Optional[str] = None

    def __post_init__(self) -> None:
        if self.phase not in PHASES:
            raise DsrunConfigError(f"{PAUSE_ENV}: phase {self.phase!r} is not one of "
                                   f"{', '.join(PHASES)}")

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> Optional[PausePoint]:
        spec = environ.get(PAUSE_ENV)
        if not spec:
            return None
        rank, sep, rest = spec.partition(":")
        phase, _, tag = rest.partition(":")
        if not sep or not rank.isdigit():
            raise DsrunConfigError(f"{PAUSE_ENV}={spec!r}: expected RANK:PHASE[:TAG]")
        return cls(int(rank), phase, environ.get(MARK_ENV), environ.get(RELEASE_ENV),
                   tag or None)

    def reached(self, rank: int, phase: str, tag: str) -> None:
        """Pause here when this is the point (module docstring)."""
        if rank != self.rank or phase != self.phase or self.tag not in (None, tag):
            return
        if self.mark:
            with open(self.mark + ".tmp", "w", encoding="utf-8") as f:
                f.write(f"{rank} {phase} {os.getpid()}\n")
            os.replace(self.mark + ".tmp", self.mark)
        while self.release is None or not os.path.exists(self.release):
            time.sleep(0.02)


@dataclass(frozen=True)
class CheckpointSettings:
    """How this engine saves (module docstring)."""

    async_save: bool = False
    timeout_s: float = DEFAULT_TIMEOUT_S
    pause: Optional[PausePoint] = None
    fsync: bool = True

    def __post_init__(self) -> None:
        if not self.timeout_s > 0:
            raise DsrunConfigError(f"checkpoint.timeout must be > 0 seconds, got {self.timeout_s}")

    @classmethod
    def from_config(cls, section: Any, environ: Optional[Mapping[str, str]] = None
                    ) -> CheckpointSettings:
        """From a ``CheckpointConfig`` (or None) and the environment (read once)."""
        env = os.environ if environ is None else environ
        return cls(async_save=bool(getattr(section, "async_save", False)),
                   timeout_s=float(getattr(section, "timeout", DEFAULT_TIMEOUT_S)),
                   pause=PausePoint.from_env(env), fsync=bool(getattr(section, "fsync", True)))
