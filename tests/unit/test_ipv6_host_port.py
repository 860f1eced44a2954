"""An IPv6 master (or any IPv6 address with a port) is shown as
``[addr]:port``: ``fd21::11:26590`` reads as one address."""

from __future__ import annotations

import socket
import time

import pytest

from dsrun.launcher import callback, netinfo
from dsrun.launcher.cluster import Cluster
from dsrun.launcher.envpolicy import job_env
from dsrun.launcher.plan import NodeFacts, build_plan, describe
from dsrun.launcher.preflight import Expectations, Rendezvous, evaluate
from dsrun.launcher.spec import LaunchSpec
from dsrun.runtime import rendezvous

EXPECT = Expectations(python="3.11.7", dsrun="0.1.0", torch="2.13.0")
FACTS = {"host": "n2", "python": "3.11.7", "dsrun": "0.1.0", "torch": "2.13.0",
         "devices": [], "cpus": 2, "ifname": "eth0",
         "reach": {"error": None, "seconds": 0.001}}


@pytest.mark.parametrize(("addr", "shown"), [
    ("fd21::11", "[fd21::11]:26590"), ("fe80::1%eth0", "[fe80::1%eth0]:26590"),
    ("10.0.0.1", "10.0.0.1:26590"), ("node1", "node1:26590")])
def test_host_port(addr: str, shown: str) -> None:
    assert netinfo.host_port(addr, 26590) == shown


def _plan(master: tuple[str, int] | None):  # noqa: ANN202 - a LaunchPlan
    cluster = Cluster("hf", ("n1", "n2"), ((0,), (0,)), (False, False), "ssh")
    facts = [NodeFacts.from_probe({"host": h, "cpus": 1}) for h in ("n1", "n2")]
    return build_plan(LaunchSpec(script="t.py", cpu=True), cluster, job_env({}, remote=True),
                      "j", facts=facts, python="/py", cwd="/", master=master)


def test_the_start_banner_brackets_an_ipv6_master() -> None:
    assert describe(_plan(("fd21::11", 26590)))[0] == \
        "world size 2 on 2 node(s), master [fd21::11]:26590"
    assert describe(_plan(("10.0.0.11", 29500)))[0] == \
        "world size 2 on 2 node(s), master 10.0.0.11:29500"


def test_doctor_lines_bracket_an_ipv6_master() -> None:
    master = Rendezvous("fd21::11", 26590)
    worker = evaluate("n2", FACTS, None, EXPECT, (0,), "worker", master)
    assert "reaches master [fd21::11]:26590, via eth0" in worker.line()
    head = evaluate("n1", {**FACTS, "reach": None}, None, EXPECT, (0,), "master", master)
    assert "master [fd21::11]:26590 (port free, held)" in head.line()


def _free_ipv6_port() -> int:
    """A port nobody listens on at ::1 (skip where this host has no IPv6)."""
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
            return int(s.getsockname()[1])
    except OSError as exc:
        pytest.skip(f"no IPv6 loopback here: {exc}")


def test_reach_and_bind_errors_bracket_ipv6() -> None:
    port = _free_ipv6_port()
    problem = netinfo.check_reach("::1", port, 2.0)
    assert problem is not None and problem.startswith(f"cannot connect to [::1]:{port}: ")


def test_launcher_dial_errors_bracket_ipv6() -> None:
    port = _free_ipv6_port()
    with pytest.raises(OSError, match=rf"cannot reach the launcher \(\[::1\]:{port}: "):
        callback._dial([("::1", port)], deadline=time.monotonic() + 0.3)


def test_rendezvous_store_errors_bracket_ipv6() -> None:
    assert "store on [fd21::11]:26590 (MASTER_PORT)" in \
        rendezvous._foreign_store_error("fd21::11", 26590, "a" * 32, None)
    assert "store on [fd21::11]:26590: Permission denied" in \
        rendezvous._bind_error("fd21::11", 26590, "Permission denied")
