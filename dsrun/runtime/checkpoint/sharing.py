"""Whether the ranks of a save or load see one directory, not one each.

dsrun's checkpoint is one directory that every rank writes its part into
and rank 0 commits; a load reads any rank's chunks. Both need one
directory that every rank shares. A path on node-local storage (a local
disk or tmpfs at the same path on every host, the copy-to-scratch
pattern, DeepSpeed's ``use_node_local_storage``) is a different directory
on each host, and these checks say so in one error naming the hosts,
instead of a missing record at the commit, a commit that waits
``checkpoint.timeout`` for records it cannot see, or a load that mixes two
checkpoints:

* **save** (:func:`write_mark`, :func:`mark_problem`,
  :func:`not_shared`): rank 0 creates ``TAG.tmp/`` with a file
  :data:`~.manifest.SAVE_ID` holding a random id of this save, which it
  sends to every rank; before any rank writes, each one reads it back
  from its own view of ``SAVE_DIR``. A network file system can show
  another client's new file late (an NFS client trusts its cached entries
  of a directory for ``acdirmin``, 30 s by default), so a rank that does
  not find it lists the directories again (which makes an NFS client
  revalidate them, as ``ls`` does) and retries for :func:`mark_wait_s`
  (up to :data:`MARK_WAIT_MAX_S`), saying so after :data:`MARK_QUIET_S`.
  A rank that still does not find it fails the save on every rank; only
  rank 0, which made ``TAG.tmp/``, removes it (a rank that did not see it
  may hold a stale view of the shared directory, through which a removal
  could reach the committed checkpoint). The commit removes the file.
* **load** (:func:`manifest_digest`, :func:`different_checkpoints`,
  :func:`different_latest`): every rank sends a digest of the manifest it
  read (the manifest holds every chunk's crc32, so equal digests mean
  equal data: identical copies on every host load), and which ``latest``
  each read; different ones are refused before anything is installed.
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
import uuid
from collections.abc import Mapping, Sequence
from typing import Any, Optional

from dsrun.errors import CheckpointError
from dsrun.runtime.checkpoint.manifest import LATEST, SAVE_ID, Manifest
from dsrun.runtime.checkpoint.storage import remove_tree

log = logging.getLogger("dsrun.runtime.checkpoint")

#: how long a rank looks for rank 0's mark before it says that it waits
MARK_QUIET_S = 2.0
#: the most it looks before it calls the directory unshared: NFS clients
#: trust cached directory entries for acdirmin (30 s by default)
MARK_WAIT_MAX_S = 30.0
#: ... and at most this share of checkpoint.timeout, well within the time
#: rank 0 waits in the exchange that follows
MARK_WAIT_SHARE = 0.25
MARK_POLL_S = 0.05
MARK_POLL_MAX_S = 1.0  # retries slow down to this (each lists two directories)
MAX_HOSTS = 8  # hosts named in one error; the rest are counted
UNSUPPORTED = "DeepSpeed's checkpoint.use_node_local_storage is not supported"


def write_mark(tmp_dir: str) -> str:
    """Rank 0: make ``tmp_dir`` with this save's id in it; the id."""
    save_id = uuid.uuid4().hex
    os.makedirs(tmp_dir, exist_ok=True)
    with open(os.path.join(tmp_dir, SAVE_ID), "w", encoding="utf-8") as f:
        f.write(save_id)
    return save_id


def mark_wait_s(timeout_s: float) -> float:
    """How long a rank looks for rank 0's mark, for ``checkpoint.timeout``
    ``timeout_s`` (module docstring)."""
    return min(MARK_WAIT_MAX_S, timeout_s * MARK_WAIT_SHARE)


def _read_mark(tmp_dir: str, save_id: str) -> Optional[str]:
    path = os.path.join(tmp_dir, SAVE_ID)
    try:
        with open(path, encoding="utf-8") as f:
            found = f.read().strip()
    except FileNotFoundError:
        return (f"finds no {tmp_dir}/" if not os.path.isdir(tmp_dir)
                else f"finds {tmp_dir}/ without {SAVE_ID}")
    except OSError as exc:
        return f"cannot read {path}: {exc}"
    except ValueError as exc:  # not UTF-8: not a mark dsrun wrote
        return f"finds an unreadable {path} ({exc})"
    return None if found == save_id else f"finds another save's {path}"


def _revalidate(tmp_dir: str) -> None:
    """List ``SAVE_DIR`` and ``TAG.tmp/``: an NFS client then checks its
    cached entries of both with the server (a cached ``TAG.tmp`` may still
    name the directory an earlier commit renamed to ``TAG``)."""
    for path in (os.path.dirname(tmp_dir), tmp_dir):
        try:
            os.listdir(path)
        except OSError:
            pass


def mark_problem(tmp_dir: str, save_id: str, wait_s: float = MARK_QUIET_S,
                 rank: Optional[int] = None) -> Optional[str]:
    """A non-zero rank (``rank``, named in the note it logs while waiting):
    None once it sees rank 0's mark ``save_id``; else what it found
    instead, after ``wait_s``."""
    start = time.monotonic()
    deadline, pause, told = start + wait_s, MARK_POLL_S, False
    while True:
        problem = _read_mark(tmp_dir, save_id)
        now = time.monotonic()
        if problem is None or now >= deadline:
            return problem
        if not told and now - start >= MARK_QUIET_S:
            told = True
            log.warning("rank %s does not see rank 0's %s yet (it %s); waiting up to %.0f s "
                        "more: a network file system can show another host's new file late, a "
                        "directory that is not shared between hosts never shows it",
                        "?" if rank is None else rank, os.path.join(tmp_dir, SAVE_ID), problem,
                        deadline - now)
        time.sleep(min(pause, deadline - now))
        pause = min(pause * 2, MARK_POLL_MAX_S)
        _revalidate(tmp_dir)


def remove_mark(tmp_dir: str) -> None:
    """The commit: the mark is not part of the checkpoint."""
    try:
        os.remove(os.path.join(tmp_dir, SAVE_ID))
    except FileNotFoundError:
        pass


def on_hosts(ranks: Sequence[int], hosts: Sequence[str]) -> str:
    """``rank 1 (host node2)``, ``ranks 2, 3 (host node2); rank 4 (host node3)``."""
    by_host: dict[str, list[int]] = {}
    for rank in ranks:
        by_host.setdefault(hosts[rank] if rank < len(hosts) else "?", []).append(rank)
    parts = []
    for host, group in list(by_host.items())[:MAX_HOSTS]:
        shown = ", ".join(map(str, group[:8])) + (", ..." if len(group) > 8 else "")
        parts.append(f"{'rank' if len(group) == 1 else 'ranks'} {shown} (host {host})")
    more = len(by_host) - MAX_HOSTS
    return "; ".join(parts) + (f"; and {more} more hosts" if more > 0 else "")


def not_shared(save_dir: str, tag: str, problems: Sequence[Optional[str]],
               hosts: Sequence[str], wait_s: float = MARK_QUIET_S) -> str:
    """The save's error when some ranks do not see rank 0's ``TAG.tmp/``
    within ``wait_s``."""
    blind = [r for r, p in enumerate(problems) if p]
    found = "; ".join(f"rank {r} {problems[r]}" for r in blind[:4])
    if len(blind) > 4:
        found += f"; ... ({len(blind) - 4} more ranks)"
    return (f"the checkpoint directory {save_dir} is not shared between hosts, or its file "
            f"system shows other hosts' files late: {on_hosts(blind, hosts)} cannot see the "
            f"{tag}.tmp/ that {on_hosts([0], hosts)} created there, within {wait_s:g} s "
            f"({found}). dsrun writes every rank's part of a checkpoint into one directory "
            "that every rank shares: save to a file system every host mounts "
            f"({UNSUPPORTED}). Nothing was written; the previous checkpoint is intact")


def manifest_digest(text: bytes) -> str:
    return hashlib.sha256(text).hexdigest()[:16]


def describe_manifest(path: str, manifest: Manifest) -> str:
    """What tells one checkpoint from another under the same tag."""
    meta = manifest.meta
    parts = [f"saved by {manifest.world_size} rank{'s' if manifest.world_size != 1 else ''}"]
    if "global_steps" in meta:
        parts.append(f"at global step {meta['global_steps']}")
    if "created" in meta:
        parts.append(f"on {meta['created']}")
    return f"{path} ({', '.join(parts)})"


def different_checkpoints(tag: str, notes: Sequence[Mapping[str, Any]],
                          hosts: Sequence[str], load_dir: str) -> Optional[str]:
    """None when every rank read the same manifest (``notes[r]["digest"]``);
    else the load's error, naming who read which (``notes[r]["what"]``)."""
    groups: dict[str, list[int]] = {}
    for rank, note in enumerate(notes):
        groups.setdefault(note["digest"], []).append(rank)
    if len(groups) == 1:
        return None
    read = "; ".join(f"{on_hosts(ranks, hosts)}: {notes[ranks[0]]['what']}"
                     for ranks in list(groups.values())[:MAX_HOSTS])
    return (f"the ranks read different checkpoints under tag {tag!r} ({read}): {load_dir} is "
            "not one directory shared by every rank (node-local storage, or copies that "
            "differ): load from a directory every rank shares, or give every host the same "
            f"copy ({UNSUPPORTED}). Nothing was loaded; the engine is unchanged")


def different_latest(tags: Sequence[Optional[str]], hosts: Sequence[str], load_dir: str) -> str:
    """The load's error when ranks that passed no tag found different
    ``latest`` files (or none)."""
    groups: dict[Optional[str], list[int]] = {}
    for rank, tag in enumerate(tags):
        groups.setdefault(tag, []).append(rank)
    latest = os.path.join(load_dir, LATEST)
    read = "; ".join(
        f"{on_hosts(ranks, hosts)} " + (f"reads {tag!r} from {latest}" if tag is not None
                                        else f"finds no {latest}")
        for tag, ranks in list(groups.items())[:MAX_HOSTS])
    return (f"the ranks read different '{LATEST}' files ({read}): is {load_dir} one directory "
            "on a file system every rank shares? Load from a shared directory, or pass the "
            "same tag= to load_checkpoint on every rank (each rank then needs that tag in its "
            f"own view of {load_dir}). Nothing was loaded")


def missing_on_some(problems: Sequence[Optional[str]], found: Sequence[bool],
                    hosts: Sequence[str], load_dir: str) -> str:
    """A hint for a load that failed on some ranks only, where the others
    found the checkpoint: '' when it does not apply."""
    ok = [r for r, p in enumerate(problems) if not p and found[r]]
    if not ok or all(not p for p in problems):
        return ""
    return (f" ({on_hosts(ok, hosts)} found it: is {load_dir} one directory on a file "
            "system every rank shares?)")


def check_save_shared(coord: Any, tmp_dir: str, save_id: Optional[str], save_dir: str,
                      tag: str, hosts: Sequence[str]) -> None:
    """Step 2 of a save, after rank 0 made ``tmp_dir`` with mark ``save_id``:
    every rank raises :func:`not_shared` when some rank does not see it
    (collective: ``coord`` is the save's Coordinator, and every rank
    reaches its exchange, whatever its look found). Only rank 0 removes
    ``tmp_dir``, which it made: a rank that did not see it may look through
    a stale view of the shared directory (module docstring); on a disk of
    its own it is a leftover of an earlier save there, which harms
    nothing."""
    problem, wait_s = None, mark_wait_s(coord.timeout_s)
    if coord.rank != 0:
        try:
            problem = mark_problem(tmp_dir, save_id or "", wait_s, coord.rank)
        except Exception as exc:  # noqa: BLE001 - reported to every rank, then raised
            problem = f"cannot check {os.path.join(tmp_dir, SAVE_ID)}: " \
                      f"{type(exc).__name__}: {exc}"
    problems = coord.exchange(problem)
    if not any(problems):
        return
    if coord.rank == 0:
        remove_tree(tmp_dir)
    raise CheckpointError(not_shared(save_dir, tag, problems, hosts, wait_s))
