"""Second names of one tensor in a DeepSpeed checkpoint (for :mod:`.from_deepspeed`).

A model may reach one parameter or buffer under several names (tied
embeddings; one submodule held as ``block``, ``blocks["0"]`` and
``also``). Its saved ``module`` state dict lists every name, its flat
groups and frozen parameters only the first. DeepSpeed's
``shared_params`` maps second names to first ones, but not all of them:
it walks ``named_children()``, which skips a module already seen under the
same parent (``also`` above), records parameters only, and stage 0
records none. :func:`module_aliases` finds the rest:

1. ``shared_params``;
2. entries holding the same storage, offset, shape and strides as an
   earlier one (``torch.save`` keeps shared storage shared): every tie at
   stages 0-2, and shared buffers at stage 3;
3. at stage 3, where a parameter's entry is a 0-element placeholder with
   storage of its own, a placeholder that no group and no frozen parameter
   holds: the module path it lies under (deepest first) whose entries are
   all second names is matched with the paths holding the same entry
   names; the matches that agree with the second names already known
   under it (``also.gain`` shares ``block.gain``'s storage: not the
   look-alike ``other``) must resolve to one set of first names (after
   steps 1-2: ``blocks.0`` is ``block``), which are its targets.

Every alias maps to a first name (chains are followed). What stays
unresolved is left to the caller (:func:`unresolved`).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any, Optional

import torch

__all__ = ["module_aliases", "storage_aliases", "unresolved"]


def _storage_key(t: torch.Tensor) -> tuple[Any, ...]:
    return (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride())


def storage_aliases(module: Mapping[str, Any]) -> dict[str, str]:
    """Later names of a non-empty tensor saved under two names -> the first."""
    first: dict[tuple[Any, ...], str] = {}
    out = {}
    for name, t in module.items():
        if not isinstance(t, torch.Tensor) or t.numel() == 0:
            continue
        key = _storage_key(t)
        if key in first:
            out[name] = first[key]
        else:
            first[key] = name
    return out


def _root(name: str, aliases: Mapping[str, str]) -> str:
    seen = {name}
    while name in aliases and aliases[name] not in seen:
        name = aliases[name]
        seen.add(name)
    return name


class _Paths:
    """The module paths of a module dict's entries, indexed once: the entries
    under each path (suffix -> full name) and the paths holding the same
    entry names, so that a structural match (:func:`_match`) costs a look-up,
    not a scan of every entry against every other; and each path's answer,
    kept while no alias was added (an ambiguous path is asked again by
    every placeholder under it)."""

    def __init__(self, names: Collection[str]) -> None:
        self.under: dict[str, dict[str, str]] = {}
        for name in names:
            dots = [i for i, c in enumerate(name) if c == "."]
            for i in dots:
                self.under.setdefault(name[: i + 1], {})[name[i + 1:]] = name
        self.alike: dict[frozenset[str], list[str]] = {}
        for prefix, entries in self.under.items():
            self.alike.setdefault(frozenset(entries), []).append(prefix)
        self.answers: dict[str, tuple[int, Optional[dict[str, str]], bool]] = {}


def _match_at(prefix: str, paths: _Paths, owned: Collection[str],
              aliases: Mapping[str, str]) -> tuple[Optional[dict[str, str]], bool]:
    """(second name -> first name of every entry under module path
    ``prefix``, or None; whether to stop looking at shallower paths)."""
    mine = paths.under[prefix]
    if any(n in owned for n in mine.values()):
        return None, True  # a module with tensors of its own is no second name
    # the second names known under it tell look-alikes apart
    known = {s: _root(n, aliases) for s, n in mine.items() if n in aliases}
    agreed: dict[tuple[tuple[str, str], ...], dict[str, str]] = {}
    for other in paths.alike[frozenset(mine)]:
        if other == prefix or prefix.startswith(other) or other.startswith(prefix):
            continue
        targets = {s: _root(n, aliases) for s, n in paths.under[other].items()}
        if all(t in owned for t in targets.values()) \
                and all(targets[s] == t for s, t in known.items()):
            agreed[tuple(sorted(targets.items()))] = targets
            if len(agreed) > 1:
                return None, False  # ambiguous here: a shallower path may tell
    if agreed:
        (targets,) = agreed.values()
        return {mine[s]: t for s, t in targets.items()}, True
    return None, False


def _match(name: str, paths: _Paths, owned: Collection[str],
           aliases: Mapping[str, str]) -> Optional[dict[str, str]]:
    """The first names of the entries under ``name``'s deepest alias-only
    module path that one structural match gives (module docstring, 3)."""
    parts = name.split(".")
    for depth in range(len(parts) - 1, 0, -1):
        prefix = ".".join(parts[:depth]) + "."
        kept = paths.answers.get(prefix)
        if kept is None or kept[0] != len(aliases):  # aliases only grow: the count dates it
            kept = (len(aliases), *_match_at(prefix, paths, owned, aliases))
            paths.answers[prefix] = kept
        if kept[2]:
            return kept[1]
    return None


def module_aliases(module: Mapping[str, Any], shared: Optional[Mapping[str, str]],
                   held: Collection[str], buffers: Collection[str], stage: int
                   ) -> dict[str, str]:
    """Second name -> first name of ``module``'s entries (module docstring);
    ``held``: the parameters the flat groups and frozen parameters hold
    (never a second name), ``buffers``: DeepSpeed's ``buffer_names``.
    Entries that are not tensors (extra state) are never aliases."""
    aliases = dict(shared) if isinstance(shared, Mapping) else {}
    for name, target in storage_aliases(module).items():
        if name not in held:
            aliases.setdefault(name, target)
    owned = set(held) | {n for n in buffers if n not in aliases}
    if stage == 3:
        paths = _Paths(list(module))
        for name in unresolved(module, owned, aliases):
            value = module[name]
            if isinstance(value, torch.Tensor) and value.numel() == 0 and name not in aliases:
                aliases.update(_match(name, paths, owned, aliases) or {})
    return {n: _root(n, aliases) for n in aliases}


def unresolved(module: Mapping[str, Any], owned: Collection[str],
               aliases: Mapping[str, str]) -> list[str]:
    """The entries that are neither held nor a second name."""
    return [n for n in module if n not in owned and n not in aliases]
