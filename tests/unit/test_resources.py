"""Host/slot selection: --include, --exclude, --num_nodes, --num_gpus."""

from __future__ import annotations

import pytest

from dsrun.errors import SelectionError
from dsrun.launcher.hostfile import Hostfile, parse_hostfile
from dsrun.launcher.resources import NodeResources, format_resources, select_resources

HOSTS = parse_hostfile(
    "worker-0 slots=4\nworker-1 slots=4\nworker-2 slots=2\nfe80::1 slots=2\n", "hf"
)


def picked(nodes: tuple[NodeResources, ...]) -> dict[str, tuple[int, ...]]:
    assert list(dict.fromkeys(n.host for n in nodes)) == [n.host for n in nodes], "host twice"
    return {node.host: node.slots for node in nodes}


ALL = {"worker-0": (0, 1, 2, 3), "worker-1": (0, 1, 2, 3), "worker-2": (0, 1),
       "fe80::1": (0, 1)}

VALID = [
    pytest.param({}, ALL, id="everything"),
    pytest.param({"include": "worker-1"}, {"worker-1": (0, 1, 2, 3)}, id="include-host"),
    pytest.param({"include": "worker-1:3,1@worker-0:2"},
                 {"worker-0": (2,), "worker-1": (1, 3)}, id="include-hostfile-order"),
    pytest.param({"include": "WORKER-2:1"}, {"worker-2": (1,)}, id="include-case-insensitive"),
    pytest.param({"include": "[fe80::1]:1"}, {"fe80::1": (1,)}, id="include-ipv6-slots"),
    pytest.param({"include": "fe80::1"}, {"fe80::1": (0, 1)}, id="include-bare-ipv6"),
    pytest.param({"include": "[fe80:0::1]"}, {"fe80::1": (0, 1)}, id="include-ipv6-bracket"),
    pytest.param({"exclude": "worker-1:0,2"},
                 {**ALL, "worker-1": (1, 3)}, id="exclude-slots"),
    pytest.param({"exclude": "worker-0@fe80::1"},
                 {"worker-1": (0, 1, 2, 3), "worker-2": (0, 1)}, id="exclude-hosts"),
    pytest.param({"exclude": "worker-2:0,1"},
                 {k: v for k, v in ALL.items() if k != "worker-2"}, id="exclude-all-slots"),
    pytest.param({"num_nodes": 2}, {"worker-0": ALL["worker-0"], "worker-1": ALL["worker-1"]},
                 id="num-nodes"),
    pytest.param({"num_gpus": 2}, {h: (0, 1) for h in ALL}, id="num-gpus"),
    pytest.param({"num_nodes": 1, "num_gpus": 3}, {"worker-0": (0, 1, 2)}, id="nodes-and-gpus"),
    pytest.param({"include": "worker-1:1,3@worker-2", "num_gpus": 1},
                 {"worker-1": (1,), "worker-2": (0,)}, id="gpus-take-first-selected"),
    pytest.param({"exclude": "worker-0", "num_nodes": 3},
                 {"worker-1": ALL["worker-1"], "worker-2": (0, 1), "fe80::1": (0, 1)},
                 id="nodes-after-exclude"),
]


@pytest.mark.parametrize("options, expected", VALID)
def test_valid_selection(options: dict, expected: dict[str, tuple[int, ...]]) -> None:
    nodes = select_resources(HOSTS, **options)
    assert picked(nodes) == expected
    assert list(picked(nodes)) == list(expected)  # hostfile order
    # the selection round-trips through --include syntax
    assert select_resources(HOSTS, include=format_resources(nodes)) == nodes


ERRORS = [
    pytest.param({"include": "worker-0", "exclude": "worker-1"}, "mutually exclusive",
                 id="both"),
    pytest.param({"include": ""}, "--include is empty", id="empty-include"),
    pytest.param({"exclude": ""}, "--exclude is empty", id="empty-exclude"),
    pytest.param({"include": "wroker-1:0"},
                 r"--include 'wroker-1:0': unknown host 'wroker-1', not in hostfile hf"
                 r" \(did you mean 'worker-1'\?\)", id="unknown-host"),
    pytest.param({"include": "zzz"}, r"unknown host 'zzz'.*\(it has worker-0, worker-1",
                 id="unknown-host-lists-hosts"),
    pytest.param({"exclude": "worker-0@nope:1"}, "--exclude 'worker-0@nope:1': unknown host "
                 "'nope'", id="unknown-host-exclude"),
    pytest.param({"include": "worker-2:2"}, r"slot 2 is out of range for host 'worker-2', "
                 r"which has 2 slots \(0-1\)", id="index-too-big"),
    pytest.param({"exclude": "worker-0:4"}, "slot 4 is out of range", id="exclude-index"),
    pytest.param({"include": "worker-0:1,1"}, "slot 1 is listed twice in 'worker-0:1,1'",
                 id="duplicate-index"),
    pytest.param({"include": "worker-0:-1"},
                 "slot index must be a non-negative integer, got '-1'", id="negative-index"),
    pytest.param({"include": "worker-0:a"}, "got 'a' in 'worker-0:a'", id="bad-index"),
    pytest.param({"include": "worker-0:0,,1"}, "got ''", id="empty-index"),
    pytest.param({"include": "worker-0:"}, "empty slot list in 'worker-0:'", id="empty-list"),
    pytest.param({"include": "worker-0@"}, "empty entry", id="trailing-at"),
    pytest.param({"include": "@worker-0"}, "empty entry", id="leading-at"),
    pytest.param({"include": "worker-0@@worker-1"}, "empty entry", id="double-at"),
    pytest.param({"include": ":0"}, "missing host name before ':' in ':0'", id="no-host"),
    pytest.param({"include": "worker-0:0:1"}, "too many ':' in 'worker-0:0:1'",
                 id="two-colons"),
    pytest.param({"include": "[fe80::1"}, "missing ']'", id="unclosed-bracket"),
    pytest.param({"include": "[fe80::1]0"}, "expected ':' after ']'", id="after-bracket"),
    pytest.param({"include": "[]:0"}, "empty host name", id="empty-brackets"),
    pytest.param({"include": "worker-0@Worker-0:1"}, "host 'worker-0' is listed twice",
                 id="duplicate-host"),
    pytest.param({"exclude": "worker-0@worker-1@worker-2@fe80::1"},
                 "leaves no slots to run on", id="exclude-everything"),
    pytest.param({"num_nodes": 0}, "--num_nodes must be at least 1, got 0", id="nodes-zero"),
    pytest.param({"num_nodes": 5}, "--num_nodes 5 asks for more hosts than the 4 available "
                 "in hostfile hf", id="nodes-too-many"),
    pytest.param({"include": "worker-0", "num_nodes": 2},
                 "than the 1 available after --include 'worker-0'", id="nodes-after-include"),
    pytest.param({"num_gpus": 0}, "--num_gpus must be at least 1, got 0", id="gpus-zero"),
    pytest.param({"num_gpus": 3}, "--num_gpus 3 asks for more slots than available in "
                 "hostfile hf: host 'worker-2' has 2, host 'fe80::1' has 2", id="gpus-short"),
    pytest.param({"exclude": "worker-0:0", "num_nodes": 1, "num_gpus": 4},
                 "after --exclude 'worker-0:0': host 'worker-0' has 3", id="gpus-after-exclude"),
]


@pytest.mark.parametrize("options, message", ERRORS)
def test_selection_errors(options: dict, message: str) -> None:
    with pytest.raises(SelectionError, match=message):
        select_resources(HOSTS, **options)


def test_empty_hostfile_selects_nothing() -> None:
    with pytest.raises(SelectionError, match="hostfile empty-hf defines no hosts"):
        select_resources(Hostfile("empty-hf", ()))


def test_node_resources_invariants() -> None:
    assert NodeResources("a", (0, 2)).spec == "a:0,2"
    assert NodeResources("::1", (1,)).spec == "[::1]:1"
    for bad in [(), (1, 0), (0, 0), (-1,)]:
        with pytest.raises(SelectionError):
            NodeResources("a", bad)


# --------------------------------------------------------------------------
# the pool of a job without a hostfile; IPv6 slot hint


def test_this_hosts_names_select_the_one_entry_without_a_hostfile():
    from dsrun.launcher.cluster import THIS_HOST
    from dsrun.launcher.hostfile import HostEntry

    pool = Hostfile(THIS_HOST, (HostEntry("vm", 4, 0),))
    here = {"vm", "localhost", "127.0.0.1", "::1"}.__contains__
    for name in ("vm", "localhost", "127.0.0.1", "[::1]"):
        assert picked(select_resources(pool, include=f"{name}:1,3", this_host=here)) == \
            {"vm": (1, 3)}
        assert picked(select_resources(pool, exclude=f"{name}:0", this_host=here)) == \
            {"vm": (1, 2, 3)}
    with pytest.raises(SelectionError) as info:
        select_resources(pool, include="other:0", this_host=here)
    assert str(info.value) == (
        "--include 'other:0': unknown host 'other': without a hostfile the job runs on this "
        "host only, named 'vm', 'localhost' or a loopback address (name a hostfile with -H "
        "for other hosts)")
    with pytest.raises(SelectionError, match="host 'vm' is listed twice"):
        select_resources(pool, include="localhost:0@vm:1", this_host=here)


def test_a_bare_ipv6_address_with_a_slot_suffix_gets_the_bracket_hint():
    with pytest.raises(SelectionError) as info:
        select_resources(HOSTS, include="fe80::1:1")
    assert str(info.value) == ("--include 'fe80::1:1': unknown host 'fe80::1:1' (an IPv6 "
                               "address); for slots of fe80::1, write [fe80::1]:1")


def test_excluded_slots_come_on_top_of_num_gpus_without_a_hostfile():
    """on 2 CPUs `--num_gpus 3` runs 3 ranks, but `--exclude
    localhost:1 --num_gpus 3` said host 'vm' "has 2" slots."""
    from dsrun.launcher.cluster import this_host_pool
    from dsrun.launcher.spec import HostsSpec

    here = {"vm", "localhost"}.__contains__
    for exclude, slots in (("localhost:1", (0, 2, 3)), ("vm:0,1", (2, 3, 4)), (None, (0, 1, 2))):
        hs = HostsSpec(exclude=exclude, num_gpus=3)
        pool = this_host_pool(hs, (), 2, "vm")
        (node,) = select_resources(pool.hostfile, exclude=exclude, num_gpus=3, this_host=here)
        assert node.slots == slots, exclude
    # without --num_gpus: one slot per CPU, less the excluded ones (no oversubscription)
    pool = this_host_pool(HostsSpec(exclude="localhost:1"), (), 2, "vm")
    (node,) = select_resources(pool.hostfile, exclude="localhost:1", this_host=here)
    assert node.slots == (0,)
    # GPU hosts: the GPUs are the slots, whatever is asked
    pool = this_host_pool(HostsSpec(exclude="localhost:1", num_gpus=3), (0, 1), 2, "vm")
    with pytest.raises(SelectionError, match="after --exclude"):
        select_resources(pool.hostfile, exclude="localhost:1", num_gpus=3, this_host=here)


def test_an_ipv6_slot_suffix_of_this_host_gets_the_bracket_hint_without_a_hostfile():
    """`--include ::1:1` (slot 1 of ::1) without a hostfile got
    only "this host only"."""
    from dsrun.launcher.cluster import THIS_HOST
    from dsrun.launcher.hostfile import HostEntry

    pool = Hostfile(THIS_HOST, (HostEntry("vm", 4, 0),))
    here = {"vm", "localhost", "127.0.0.1", "::1"}.__contains__
    with pytest.raises(SelectionError) as info:
        select_resources(pool, include="::1:1", this_host=here)
    assert str(info.value) == ("--include '::1:1': unknown host '::1:1' (an IPv6 address); "
                               "for slots of ::1, write [::1]:1")
    assert picked(select_resources(pool, include="[::1]:1", this_host=here)) == {"vm": (1,)}
    with pytest.raises(SelectionError, match="this host only"):  # not this host: no hint
        select_resources(pool, include="fe80::1:1", this_host=here)


@pytest.mark.parametrize("text, highest", [
    (None, None), ("h", None), ("h:0,7@g:3", 7), ("[::1]:2", 2), ("h:x,4", 4), ("h:", None)])
def test_highest_slot(text, highest):
    from dsrun.launcher.resources import highest_slot

    assert highest_slot(text) == highest
