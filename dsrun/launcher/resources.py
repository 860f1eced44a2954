"""Choose which hosts and slots of a hostfile a job runs on (pure).

``--include``/``--exclude`` use DeepSpeed's syntax: ``NODE[@NODE...]``
where ``NODE`` is ``HOST`` (all its slots) or ``HOST:I[,I...]`` (those slot
indices). IPv6 hosts are written ``[ADDR]`` or ``[ADDR]:I,...``. Unlike
DeepSpeed, every part is checked against the hostfile and a bad part is an
error that names it: unknown host, index out of range, duplicate index or
host, empty slot list or host. ``--num_nodes K`` then keeps the first K
hosts and ``--num_gpus G`` the first G slots of each; asking for more than
there is is an error, never a silent shrink.

Invariants of the result: hosts in hostfile order, each once, each with a
non-empty, ascending tuple of distinct slot indices below its slot count.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Optional

from dsrun.errors import SelectionError
from dsrun.launcher.hostfile import HostEntry, Hostfile, did_you_mean, host_key, host_problem

NODE_SEP = "@"
SLOT_LIST_START = ":"
SLOT_SEP = ","


@dataclass(frozen=True)
class NodeResources:
    """The selected slot (device) indices of one host, ascending."""

    host: str
    slots: tuple[int, ...]

    def __post_init__(self) -> None:
        if not self.slots:
            raise SelectionError(f"no slots selected on host {self.host!r}")
        if any(isinstance(s, bool) or not isinstance(s, int) or s < 0 for s in self.slots):
            raise SelectionError(f"bad slot indices for host {self.host!r}: {self.slots!r}")
        if list(self.slots) != sorted(set(self.slots)):
            raise SelectionError(
                f"slot indices of host {self.host!r} must be ascending and distinct: "
                f"{self.slots!r}"
            )

    @property
    def spec(self) -> str:
        """This node in ``--include`` syntax, e.g. ``worker-0:0,1``."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}{SLOT_LIST_START}{SLOT_SEP.join(map(str, self.slots))}"


def format_resources(nodes: Sequence[NodeResources]) -> str:
    """A selection in ``--include`` syntax; selecting it again gives ``nodes``."""
    return NODE_SEP.join(node.spec for node in nodes)


# parsed filter part: the hostfile entry and its slot indices (None = all)
_Part = tuple[HostEntry, Optional[tuple[int, ...]]]


def _split_part(part: str, where: str) -> tuple[str, str | None]:
    """``(host, slot list text or None)`` of one ``@``-separated part."""
    if not part:
        raise SelectionError(f"{where}: empty entry (leading, trailing or doubled '{NODE_SEP}')")
    if part.startswith("["):
        close = part.find("]")
        if close < 0:
            raise SelectionError(f"{where}: missing ']' in {part!r}")
        host, rest = part[1:close], part[close + 1:]
        if rest and not rest.startswith(SLOT_LIST_START):
            raise SelectionError(f"{where}: expected ':' after ']' in {part!r}, got {rest!r}")
        if not host:
            raise SelectionError(f"{where}: empty host name in {part!r}")
        return host, (rest[1:] if rest else None)
    if part.count(SLOT_LIST_START) > 1:
        if host_problem(part) is None:  # a bare IPv6 address means the whole host
            return part, None
        raise SelectionError(
            f"{where}: too many ':' in {part!r} (write IPv6 hosts as [address]:slots)"
        )
    host, colon, slot_text = part.partition(SLOT_LIST_START)
    if not host:
        raise SelectionError(f"{where}: missing host name before ':' in {part!r}")
    return host, (slot_text if colon else None)


def _parse_slot_list(text: str, entry: HostEntry, part: str, where: str) -> tuple[int, ...]:
    if not text:
        raise SelectionError(f"{where}: empty slot list in {part!r}")
    indices: list[int] = []
    for item in text.split(SLOT_SEP):
        if not item.isascii() or not item.isdigit():
            raise SelectionError(
                f"{where}: slot index must be a non-negative integer, got {item!r} in {part!r}"
            )
        index = int(item)
        if index >= entry.slots:
            raise SelectionError(
                f"{where}: slot {index} is out of range for host {entry.host!r}, which has "
                f"{entry.slots} slot{'s' if entry.slots != 1 else ''} (0-{entry.slots - 1})"
            )
        if index in indices:
            raise SelectionError(f"{where}: slot {index} is listed twice in {part!r}")
        indices.append(index)
    return tuple(sorted(indices))


def _known_hosts(hostfile: Hostfile, limit: int = 8) -> str:
    shown = ", ".join(hostfile.hosts[:limit])
    more = f", ... ({len(hostfile.hosts)} in all)" if len(hostfile.hosts) > limit else ""
    return f" (it has {shown}{more})"


def _ipv6_slots_hint(host: str) -> str:
    """For ``fe80::1:1`` (an IPv6 address, so taken whole): how to write
    slot 1 of ``fe80::1``."""
    base, _, last = host.rpartition(SLOT_LIST_START)
    if host.count(SLOT_LIST_START) < 3 or not (last.isascii() and last.isdigit()) \
            or not base or host_problem(base) is not None:
        return ""
    return f"; for slots of {base}, write [{base}]:{last}"


def _unknown_host(where: str, host: str, hostfile: Hostfile,
                  this_host: Callable[[str], bool] | None) -> SelectionError:
    """The error for ``host``, not in ``hostfile`` (``this_host``: as in
    :func:`_parse_filter`), with the IPv6 slot hint when the address less
    its last group is a host of the job (``::1:1``: slot 1 of ``::1``)."""
    hint = _ipv6_slots_hint(host)
    base = host.rpartition(SLOT_LIST_START)[0]
    if hint and (hostfile.get(base) is not None or (this_host is not None and this_host(base))):
        return SelectionError(f"{where}: unknown host {host!r} (an IPv6 address){hint}")
    if this_host is not None:  # the pool of a job without a hostfile: this host alone
        return SelectionError(
            f"{where}: unknown host {host!r}: without a hostfile the job runs on this host "
            f"only, named {hostfile.hosts[0]!r}, 'localhost' or a loopback address "
            f"(name a hostfile with -H for other hosts)")
    return SelectionError(f"{where}: unknown host {host!r}, not in hostfile {hostfile.path}"
                          + (did_you_mean(host, hostfile.hosts) or _known_hosts(hostfile)))


def _parse_filter(text: str, option: str, hostfile: Hostfile,
                  this_host: Callable[[str], bool] | None = None) -> list[_Part]:
    """Check every part of an include/exclude string against the hostfile;
    ``this_host`` (a job without a hostfile): whether a name is this machine,
    so each of its names selects the one entry."""
    where = f"{option} {text!r}"
    if not text:
        raise SelectionError(f"{option} is empty")
    parts: list[_Part] = []
    seen: set[str] = set()
    for part in text.split(NODE_SEP):
        host, slot_text = _split_part(part, where)
        entry = hostfile.get(host)
        if entry is None and this_host is not None and this_host(host):
            entry = hostfile.entries[0]
        if entry is None:
            raise _unknown_host(where, host, hostfile, this_host)
        key = host_key(entry.host)
        if key in seen:
            raise SelectionError(f"{where}: host {entry.host!r} is listed twice")
        seen.add(key)
        slots = None if slot_text is None else _parse_slot_list(slot_text, entry, part, where)
        parts.append((entry, slots))
    return parts


def highest_slot(text: str | None) -> int | None:
    """The highest slot index an include/exclude string names, or None
    (loosely read: its errors are :func:`select_resources`' to report)."""
    return max(_named_slots(text), default=None)


def slot_count(text: str | None) -> int:
    """How many distinct slot indices an include/exclude string names
    (loosely read, as :func:`highest_slot`)."""
    return len(set(_named_slots(text)))


def _named_slots(text: str | None) -> list[int]:
    """The slot indices an include/exclude string names, in order."""
    found: list[int] = []
    for part in (text or "").split(NODE_SEP):
        try:
            slot_text = _split_part(part, "")[1]
        except SelectionError:
            continue
        found += [int(i) for i in (slot_text or "").split(SLOT_SEP) if i.isascii() and i.isdigit()]
    return found


def _include(hostfile: Hostfile, parts: list[_Part]) -> list[NodeResources]:
    chosen = {host_key(entry.host): slots for entry, slots in parts}
    nodes = []
    for entry in hostfile.entries:  # hostfile order, not the order given
        key = host_key(entry.host)
        if key in chosen:
            slots = chosen[key]
            if slots is None:
                slots = tuple(range(entry.slots))
            nodes.append(NodeResources(entry.host, slots))
    return nodes


def _exclude(hostfile: Hostfile, parts: list[_Part]) -> list[NodeResources]:
    removed = {host_key(entry.host): slots for entry, slots in parts}
    nodes = []
    for entry in hostfile.entries:
        key = host_key(entry.host)
        if key in removed and removed[key] is None:
            continue
        gone = set(removed.get(key) or ())
        kept = tuple(i for i in range(entry.slots) if i not in gone)
        if kept:
            nodes.append(NodeResources(entry.host, kept))
    return nodes


def _take_nodes(nodes: list[NodeResources], num_nodes: int, context: str) -> list[NodeResources]:
    if num_nodes < 1:
        raise SelectionError(f"--num_nodes must be at least 1, got {num_nodes}")
    if num_nodes > len(nodes):
        raise SelectionError(
            f"--num_nodes {num_nodes} asks for more hosts than the {len(nodes)} "
            f"available{context}"
        )
    return nodes[:num_nodes]


def _take_gpus(nodes: list[NodeResources], num_gpus: int, context: str) -> list[NodeResources]:
    if num_gpus < 1:
        raise SelectionError(f"--num_gpus must be at least 1, got {num_gpus}")
    short = [node for node in nodes if len(node.slots) < num_gpus]
    if short:
        counts = ", ".join(f"host {node.host!r} has {len(node.slots)}" for node in short)
        raise SelectionError(
            f"--num_gpus {num_gpus} asks for more slots than available{context}: {counts}"
        )
    return [NodeResources(node.host, node.slots[:num_gpus]) for node in nodes]


def select_resources(
    hostfile: Hostfile,
    include: str | None = None,
    exclude: str | None = None,
    num_nodes: int | None = None,
    num_gpus: int | None = None,
    this_host: Callable[[str], bool] | None = None,
) -> tuple[NodeResources, ...]:
    """The hosts and slots a job runs on; SelectionError naming the bad part.

    ``None`` means "not given"; an empty include/exclude string is an error.
    include and exclude are mutually exclusive; num_nodes and num_gpus apply
    after them, in that order. ``this_host``: given for the one-entry pool
    of a job without a hostfile, whether a name in a filter is this machine
    (its name, ``localhost``, a loopback address: all select the entry).
    """
    if include is not None and exclude is not None:
        raise SelectionError("--include and --exclude are mutually exclusive")
    if not hostfile.entries:
        raise SelectionError(f"hostfile {hostfile.path} defines no hosts")
    context = f" in hostfile {hostfile.path}"
    if include is not None:
        nodes = _include(hostfile, _parse_filter(include, "--include", hostfile, this_host))
        context = f" after --include {include!r}"
    elif exclude is not None:
        nodes = _exclude(hostfile, _parse_filter(exclude, "--exclude", hostfile, this_host))
        context = f" after --exclude {exclude!r}"
        if not nodes:
            raise SelectionError(f"--exclude {exclude!r} leaves no slots to run on")
    else:
        nodes = [NodeResources(e.host, tuple(range(e.slots))) for e in hostfile.entries]
    if num_nodes is not None:
        nodes = _take_nodes(nodes, num_nodes, context)
    if num_gpus is not None:
        nodes = _take_gpus(nodes, num_gpus, context)
    return tuple(nodes)
