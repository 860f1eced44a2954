"""Tags and the ``latest`` file: which directory of a checkpoint root to use (pure I/O, no torch).

A tag names one directory under the save directory, so it must be one
plain path component: not empty, no ``/`` or ``\\``, not ``.``/``..``,
not ``latest``, not ending in ``.tmp`` or ``.replaced`` (the names a save
in progress and a replaced tag use), without control characters, and
valid text: a lone surrogate (``'\\udcff'``, what :func:`os.fsdecode` makes of
undecodable bytes) cannot be written to ``latest`` as UTF-8. A save
also needs the tag, encoded as the file system encodes names
(:func:`os.fsencode`), plus the longest of those suffixes (``.replaced``)
to fit in one name of the save directory's file system (``NAME_MAX``,
usually 255 bytes, and never taken as more: vfat and exFAT report 1530
while they hold 255 UTF-16 units): :func:`check_tag_fits`, before
anything is written.
``latest`` holds the newest complete tag as text, as in DeepSpeed. Tags
are listed in natural order (``global_step3`` before ``global_step12``).

:func:`remove_stale_saves` (rank 0, after a successful commit) removes
interrupted saves of *other* tags: ``OTHER.tmp/`` directories that hold
only the files a save writes and none of which changed for
``checkpoint.timeout`` seconds - the time after which a committer gives a
silent rank up, so no save still running can be writing there. Anything
else under a ``.tmp`` name is left alone.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import time
from typing import Any, Optional

from dsrun.errors import CheckpointError
from dsrun.runtime.checkpoint.from_deepspeed_kinds import (
    deepspeed_advice,
    is_deepspeed_tag,
    natural_key,
)
from dsrun.runtime.checkpoint.manifest import (
    DATA_SUFFIX,
    ENGINE_STATE,
    ERROR_SUFFIX,
    LATEST,
    MANIFEST,
    RANK_PREFIX,
    RECORD_SUFFIX,
    REPLACED_SUFFIX,
    SAVE_ID,
    TMP_SUFFIX,
)

log = logging.getLogger("dsrun.runtime.checkpoint")


def _either(*names: str) -> str:
    return "(?:" + "|".join(map(re.escape, names)) + ")"


# the files (and their atomic_write temporaries) a save puts into TAG.tmp/
SAVE_FILE = re.compile(
    "(?:" + _either(ENGINE_STATE, MANIFEST, SAVE_ID) + "|" + re.escape(RANK_PREFIX) + r"\d{5,}"
    + _either(DATA_SUFFIX, RECORD_SUFFIX, ERROR_SUFFIX) + r")(?:\.tmp\.\d+)?")


def tag_problem(tag: Any) -> Optional[str]:
    """Why ``tag`` cannot name a checkpoint directory, or None."""
    if not isinstance(tag, str):
        return f"the tag must be a string, got {type(tag).__name__} {tag!r}"
    if not tag or tag in (".", "..", LATEST):
        return f"the tag {tag!r} is reserved or empty"
    if "/" in tag or "\\" in tag or any(ord(c) < 32 for c in tag):
        return f"the tag {tag!r} must be a single directory name (no '/', no control characters)"
    if tag.endswith((TMP_SUFFIX, REPLACED_SUFFIX)):
        return f"the tag {tag!r} ends in {TMP_SUFFIX} or {REPLACED_SUFFIX}, which dsrun uses itself"
    try:  # `latest` holds the tag as UTF-8; the directory's name is os.fsencode(tag)
        tag.encode("utf-8")
        os.fsencode(tag)
    except UnicodeEncodeError as exc:
        return (f"the tag {tag!r} cannot be a directory name: {tag[exc.start]!r} at index "
                f"{exc.start} is not a character ({exc.reason}; a lone surrogate, e.g. "
                "os.fsdecode() of bytes that are not UTF-8)")
    return None


def check_tag(tag: Any) -> None:
    problem = tag_problem(tag)
    if problem:
        raise CheckpointError(problem)


# the longest name dsrun derives from a tag in the save directory (TAG.replaced)
LONGEST_SUFFIX = max(TMP_SUFFIX, REPLACED_SUFFIX, key=len)
# Linux, macOS, Windows: where os.pathconf cannot say, and the most it is
# believed: vfat/exFAT report 255 UTF-16 units x 6 bytes (1530) but hold 255 units
DEFAULT_NAME_MAX = 255


def max_tag_bytes(name_max: int) -> int:
    """The longest tag, in bytes, whose directories fit names of ``name_max`` bytes."""
    return name_max - len(os.fsencode(LONGEST_SUFFIX))


def length_problem(tag: str, name_max: int, where: str) -> Optional[str]:
    """Why ``tag`` is too long for names of at most ``name_max`` bytes (the
    file system of ``where``), or None (pure)."""
    size, limit = len(os.fsencode(tag)), max_tag_bytes(name_max)
    if size <= limit:
        return None
    return (f"the tag {tag!r} is {size} bytes long (os.fsencode), more than the {limit} a "
            f"checkpoint tag may have in {where}: its file system allows names of {name_max} "
            f"bytes and dsrun also names the tag's directory TAG{LONGEST_SUFFIX} while it "
            "replaces it; use a shorter tag (nothing was written)")


def nearest_existing(path: str) -> str:
    """``path`` (made absolute), or its nearest ancestor that exists: where
    to ask about the file system a directory not made yet would be on."""
    probe = os.path.abspath(path)
    while not os.path.exists(probe) and os.path.dirname(probe) != probe:
        probe = os.path.dirname(probe)
    return probe


def name_max(path: str) -> int:
    """``NAME_MAX`` of the file system ``path`` is (or would be) on: asked of
    its nearest existing ancestor, at most :data:`DEFAULT_NAME_MAX`, which is
    also the answer where the system cannot say."""
    try:
        found = os.pathconf(nearest_existing(path), "PC_NAME_MAX")
    except (AttributeError, ValueError, OSError):  # no pathconf (Windows), or no answer
        return DEFAULT_NAME_MAX
    return min(found, DEFAULT_NAME_MAX) if isinstance(found, int) and found > 0 \
        else DEFAULT_NAME_MAX


def check_tag_fits(tag: str, save_dir: str) -> None:
    """Raise when the directories a save of ``tag`` makes in ``save_dir``
    would have names too long for its file system (module docstring)."""
    problem = length_problem(tag, name_max(save_dir), save_dir)
    if problem:
        raise CheckpointError(problem)


def read_latest(root: str) -> Optional[str]:
    """The tag in ``root/latest``, or None when there is no such file."""
    path = os.path.join(root, LATEST)
    try:
        with open(path, encoding="utf-8") as f:
            tag = f.read().strip()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise CheckpointError(f"cannot read {path}: {exc}") from None
    if tag_problem(tag):
        raise CheckpointError(f"{path} does not hold a valid tag ({tag_problem(tag)})")
    return tag


def list_tags(root: str) -> tuple[list[str], list[str]]:
    """(complete tags, interrupted saves) under ``root``, in natural order."""
    complete, partial = [], []
    try:
        names = sorted(os.listdir(root), key=natural_key)
    except OSError:
        return [], []
    for name in names:
        path = os.path.join(root, name)
        if not os.path.isdir(path):
            continue
        if name.endswith(TMP_SUFFIX):
            partial.append(name[: -len(TMP_SUFFIX)])
        elif os.path.exists(os.path.join(path, MANIFEST)):
            complete.append(name)
    return complete, partial


def tag_dir(root: str, tag: str) -> str:
    """The directory of complete tag ``tag`` under ``root``, or an error
    that lists the tags there are."""
    check_tag(tag)
    path = os.path.join(root, tag)
    if os.path.isdir(path) and os.path.exists(os.path.join(path, MANIFEST)):
        return path
    aside = path + REPLACED_SUFFIX
    if not os.path.isdir(path) and os.path.exists(os.path.join(aside, MANIFEST)):
        return aside  # a crash while the same tag was being saved again
    complete, partial = list_tags(root)
    if tag in partial and not os.path.isdir(path):
        why = (f"its save never finished (only {tag}{TMP_SUFFIX}/ exists: the job stopped "
               "during the save)")
    elif is_deepspeed_tag(path):
        raise CheckpointError(f"cannot load tag {tag!r} from {root}: "
                              f"{deepspeed_advice(root, tag)}")
    elif os.path.isdir(path):
        why = f"{path} has no {MANIFEST}: it is not a dsrun checkpoint"
    else:
        why = "there is no such tag"
    have = ", ".join(complete) if complete else "none"
    raise CheckpointError(f"cannot load tag {tag!r} from {root}: {why}; complete tags there: "
                          f"{have}")


def remove_stale_saves(save_dir: str, tag: str, idle_s: float) -> list[str]:
    """Remove interrupted saves of tags other than ``tag`` that no save
    can be writing any more (module docstring); the tags removed. Never
    raises: what cannot go is logged."""
    now, removed = time.time(), []
    try:
        names = os.listdir(save_dir)
    except OSError:
        return removed
    for name in names:
        path = os.path.join(save_dir, name)
        if not name.endswith(TMP_SUFFIX) or name == tag + TMP_SUFFIX or os.path.islink(path):
            continue
        try:
            entries = os.listdir(path)
            if not entries or not all(SAVE_FILE.fullmatch(e) for e in entries):
                continue  # not (only) a save's files: not ours to remove
            newest = max(os.stat(p).st_mtime
                         for p in (path, *(os.path.join(path, e) for e in entries)))
        except OSError:
            continue
        if now - newest >= idle_s:
            log.info("removing %s: a save interrupted %.0f s ago", path, now - newest)
            shutil.rmtree(path, onerror=lambda _f, p, e: log.warning("cannot remove %s: %s",
                                                                     p, e[1]))
            removed.append(name[: -len(TMP_SUFFIX)])
    return removed
