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
  from its own view of ``SAVE_DIR`` (retrying for :data:`MARK_WAIT_S`, for
  network file systems that show another client's new file late). A rank
  that does not find it fails the save on every rank; the commit removes
  the file.
* **load** (:func:`manifest_digest`, :func:`different_checkpoints`,
  :func:`different_latest`): every rank sends a digest of the manifest it
  read (the manifest holds every chunk's crc32, so equal digests mean
  equal data: identical copies on every host load), and which ``latest``
  each read; different ones are refused before anything is installed.
"""

from __future__ import annotations

import hashlib
import os
import time
import uuid
from collections.abc import Mapping, Sequence
from typing import Any, Optional

from dsrun.errors import CheckpointError
from dsrun.runtime.checkpoint.manifest import LATEST, SAVE_ID, Manifest
from dsrun.runtime.checkpoint.storage import remove_tree

#: how long a rank looks for rank 0's mark before it calls the directory unshared
MARK_WAIT_S = 2.0
MARK_POLL_S = 0.05
MAX_HOSTS = 8  # hosts named in one error; the rest are counted
UNSUPPORTED = "DeepSpeed's checkpoint.use_node_local_storage is not supported"


def write_mark(tmp_dir: str) -> str:
    """Rank 0: make ``tmp_dir`` with this save's id in it; the id."""
    save_id = uuid.uuid4().hex
    os.makedirs(tmp_dir, exist_ok=True)
    with open(os.path.join(tmp_dir, SAVE_ID), "w", encoding="utf-8") as f:
        f.write(save_id)
    return save_id


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
    return None if found == save_id else f"finds another save's {path}"


def mark_problem(tmp_dir: str, save_id: str, wait_s: float = MARK_WAIT_S) -> Optional[str]:
    """A non-zero rank: None once it sees rank 0's mark ``save_id``; else
    what it found instead, after ``wait_s``."""
    deadline = time.monotonic() + wait_s
    while True:
        problem = _read_mark(tmp_dir, save_id)
        if problem is None or time.monotonic() >= deadline:
            return problem
        time.sleep(MARK_POLL_S)


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
               hosts: Sequence[str]) -> str:
    """The save's error when some ranks do not see rank 0's ``TAG.tmp/``."""
    blind = [r for r, p in enumerate(problems) if p]
    found = "; ".join(f"rank {r} {problems[r]}" for r in blind[:4])
    if len(blind) > 4:
        found += f"; ... ({len(blind) - 4} more ranks)"
    return (f"the checkpoint directory {save_dir} is not shared between hosts: "
            f"{on_hosts(blind, hosts)} cannot see the {tag}.tmp/ that {on_hosts([0], hosts)} "
            f"created there ({found}). dsrun writes every rank's part of a checkpoint into "
            "one directory that every rank shares: save to a file system every host mounts "
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
    (collective: ``coord`` is the save's Coordinator). Rank 0 and the ranks
    that did not see it remove ``tmp_dir`` from their own view first (on
    another host it is a leftover of an earlier save there)."""
    problem = None
    if coord.rank != 0:
        problem = mark_problem(tmp_dir, save_id or "")
    problems = coord.exchange(problem)
    if not any(problems):
        return
    if coord.rank == 0 or problem:
        remove_tree(tmp_dir)
    raise CheckpointError(not_shared(save_dir, tag, problems, hosts))
