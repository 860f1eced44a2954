"""Slurm's compact host and task lists, expanded (pure).

Used by the launcher (the nodes of an allocation) and by the runtime (the
master of a job started by ``srun``). Syntax, as Slurm writes it:

- host lists: ``node[1-3,07],login,rack[1-2]-gpu[0-1]``: comma-separated
  items; each bracket group is a list of numbers and ranges, and a range
  keeps the zero padding of its lower bound (``[07-09]`` -> 07, 08, 09);
  several groups in one item expand as a cartesian product, left to right.
- task counts per node: ``2(x3),1`` -> 2, 2, 2, 1.

Invariants: expansion preserves order; a malformed list raises ValueError
naming the list and the offending part.
"""

from __future__ import annotations

import re

_COUNT = re.compile(r"(\d+)(?:\(x(\d+)\))?\Z")


def _split_top(text: str) -> list[str]:
    """Split on commas that are not inside brackets."""
    items, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "[":
            depth += 1
            if depth > 1:
                raise ValueError(f"host list {text!r}: nested '['")
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise ValueError(f"host list {text!r}: ']' without '['")
        elif ch == "," and depth == 0:
            items.append(text[start:i])
            start = i + 1
    if depth:
        raise ValueError(f"host list {text!r}: '[' without ']'")
    items.append(text[start:])
    return items


def _numbers(group: str, whole: str) -> list[str]:
    out = []
    for part in group.split(","):
        low, sep, high = part.partition("-")
        if not low.isdigit() or (sep and not high.isdigit()):
            raise ValueError(f"host list {whole!r}: bad range {part!r}")
        if not sep:
            out.append(low)
            continue
        if int(high) < int(low):
            raise ValueError(f"host list {whole!r}: range {part!r} runs backwards")
        width = len(low)
        out.extend(str(n).zfill(width) for n in range(int(low), int(high) + 1))
    return out


def _expand_item(item: str, whole: str) -> list[str]:
    head, sep, rest = item.partition("[")
    if not sep:
        return [item]
    group, _, tail = rest.partition("]")
    return [head + n + t for n in _numbers(group, whole) for t in _expand_item(tail, whole)]


def expand_hostlist(text: str) -> list[str]:
    """``node[1-2],x`` -> ``['node1', 'node2', 'x']``."""
    text = text.strip()
    if not text:
        return []
    hosts = []
    for item in _split_top(text):
        if not item:
            raise ValueError(f"host list {text!r}: empty item")
        hosts.extend(_expand_item(item, text))
    return hosts


def expand_counts(text: str) -> list[int]:
    """``2(x3),1`` -> ``[2, 2, 2, 1]`` (SLURM_TASKS_PER_NODE and friends)."""
    counts: list[int] = []
    for part in text.strip().split(","):
        m = _COUNT.match(part.strip())
        if m is None:
            raise ValueError(f"task count list {text!r}: bad part {part!r}")
        counts.extend([int(m.group(1))] * int(m.group(2) or 1))
    return counts
